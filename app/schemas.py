"""Request and response models of the REST API."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.api.responses import MAX_ID
from tiering.catalog import FileRecord
from tiering.engine import MigrationInfo, PolicyInfo, TierInfo
from tiering.placement import Decision, PlannedMove
from tiering.tiers import UNBOUNDED

__all__ = [
    "DecisionOut",
    "PlanExplainOut",
    "ReasonOut",
    "FileList",
    "FileOut",
    "MigrationList",
    "MigrationOut",
    "MigrationsStarted",
    "MoveRequest",
    "PinRequest",
    "PlanOut",
    "PlannedMoveOut",
    "PolicyOut",
    "TierOut",
    "iso",
]


def iso(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


class FileOut(BaseModel):
    id: int
    path: str
    tier: str
    size: int = Field(description="Bytes of the file (what readers get)")
    checksum: str | None = Field(description="Checksum of those bytes")
    codec: str | None = Field(
        description="How its tier stores it compressed (`tierdz1`: tierd's format), or null: "
        "stored as it is"
    )
    stored_size: int = Field(description="Bytes it takes on its tier (size, unless compressed)")
    mtime: datetime
    mtime_ns: int
    access_count: int
    heat: float = Field(description="Accesses, decayed by the half-life to the time of the reply")
    last_access: datetime | None
    pinned_tier: str | None
    state: str
    detail: str | None
    generation: int
    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, rec: FileRecord, heat: float) -> FileOut:
        return cls(
            id=rec.id,
            path=rec.relpath,
            tier=rec.tier,
            size=rec.size,
            checksum=rec.checksum,
            codec=rec.codec,
            stored_size=rec.size if rec.stored_size is None else rec.stored_size,
            mtime=datetime.fromtimestamp(rec.mtime_ns / 1e9, UTC),
            mtime_ns=rec.mtime_ns,
            access_count=rec.access_count,
            heat=round(heat, 6),
            last_access=iso(rec.last_access),
            pinned_tier=rec.pinned_tier,
            state=rec.state,
            detail=rec.detail,
            generation=rec.generation,
            created_at=datetime.fromtimestamp(rec.created_at, UTC),
            updated_at=datetime.fromtimestamp(rec.updated_at, UTC),
        )


class FileList(BaseModel):
    items: list[FileOut]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null at end")


class TierOut(BaseModel):
    """A storage tier, or the memory tier: a cache of copies in pinned host memory above them
    (rank -1; its capacity is its quota, used and file bytes what its copies hold, files how
    many copies; the catalog never places a file there)."""

    name: str
    rank: int = Field(description="0 is the fastest storage tier; -1 the memory tier above them")
    kind: str = Field(
        description="The backend: `directory` (a local root), `object` (S3) or `memory`"
    )
    path: str = Field(description="Where the tier is: a directory, or `s3://bucket/prefix`")
    capacity_bytes: int | None = Field(description="Null where the backend has no capacity")
    used_bytes: int | None = Field(
        description="Bytes in use on the filesystem, by anyone; null for an object store"
    )
    free_bytes: int | None = Field(description="Null where the backend sets no limit")
    quota_bytes: int | None
    files: int = Field(description="Files the catalog places on this tier")
    file_bytes: int = Field(description="Bytes of those files (logical: what readers get)")
    stored_bytes: int = Field(
        description="Bytes those files take on the tier: file_bytes less what compression "
        "saves; quotas count these"
    )
    gds: bool = Field(
        description="Loads from this tier take GPUDirect Storage (cuFile + nvidia-fs) on this host"
    )

    @classmethod
    def of(cls, t: TierInfo, *, gds_host: bool = False) -> TierOut:
        return cls(
            name=t.name,
            rank=t.rank,
            kind=t.kind,
            path=t.path,
            capacity_bytes=t.space.total,
            used_bytes=t.space.used,
            free_bytes=None if t.space.free >= UNBOUNDED else t.space.free,
            quota_bytes=t.quota_bytes,
            files=t.files,
            file_bytes=t.used_bytes,
            stored_bytes=t.stored_bytes,
            # The direct path is for the fastest tier; slower tiers go through bounce buffers.
            gds=gds_host and t.rank == 0 and t.capabilities.direct_gpu,
        )


# -- policy and migrations -----------------------------------------------------------------------
class PolicyOut(BaseModel):
    version: int = Field(description="Policy version in force; 0 is the built-in default")
    created_at: datetime | None
    author: str | None
    policy: dict[str, Any] = Field(description="The policy document (what PUT accepts)")

    @classmethod
    def of(cls, info: PolicyInfo) -> PolicyOut:
        return cls(
            version=info.version,
            created_at=iso(info.created_at),
            author=info.author,
            policy=info.policy.document(),
        )


class PlannedMoveOut(BaseModel):
    file_id: int
    path: str
    from_tier: str
    to_tier: str
    size: int
    heat: float
    kind: str = Field(description="pin, promote, demote, watermark or gather (a split model)")
    reason: str

    @classmethod
    def of(cls, m: PlannedMove) -> PlannedMoveOut:
        return cls(
            file_id=m.file_id,
            path=m.relpath,
            from_tier=m.src,
            to_tier=m.dst,
            size=m.size,
            heat=m.heat,
            kind=m.kind,
            reason=m.reason,
        )


class PlanOut(BaseModel):
    policy_version: int | None = Field(description="Version planned with; null for a draft")
    at: datetime
    moves: list[PlannedMoveOut]


class MigrationOut(BaseModel):
    id: int
    file_id: int | None
    path: str
    from_tier: str
    to_tier: str
    state: str = Field(description="copying, switched (in flight), done, aborted or failed")
    in_flight: bool
    reason: str | None
    size: int
    bytes_copied: int
    started_at: datetime
    finished_at: datetime | None
    duration_s: float | None
    error: str | None

    @classmethod
    def of(cls, info: MigrationInfo) -> MigrationOut:
        r = info.record
        return cls(
            id=r.id,
            file_id=r.file_id,
            path=r.relpath,
            from_tier=r.src_tier,
            to_tier=r.dst_tier,
            state=r.phase,
            in_flight=info.in_flight,
            reason=r.reason,
            size=r.size,
            bytes_copied=info.bytes_copied,
            started_at=datetime.fromtimestamp(r.started_at, UTC),
            finished_at=iso(r.finished_at),
            duration_s=None if info.duration_s is None else round(info.duration_s, 6),
            error=r.error,
        )


class MigrationList(BaseModel):
    items: list[MigrationOut]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null at end")


class MoveRequest(BaseModel):
    """A manual move; send no body (or ``{}``) to run the policy's plan now instead."""

    model_config = ConfigDict(extra="forbid")

    file_id: int | None = Field(default=None, ge=1, le=MAX_ID)
    to_tier: str | None = Field(default=None, max_length=64)


class MigrationsStarted(BaseModel):
    planned: int = Field(description="Moves the plan had (1 for a manual move)")
    migrations: list[MigrationOut]
    skipped: list[dict[str, Any]] = Field(description="Planned moves not started, and why")


class PinRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tier: str | None = Field(default=None, max_length=64, description="Default: where it is")


class ReasonOut(BaseModel):
    code: str = Field(
        description="hysteresis, min_age, quota, free_space, pin, in_flight, state or "
        "scheduler_disabled"
    )
    message: str
    data: dict[str, Any] = Field(default_factory=dict, description="The reason's numbers")


class DecisionOut(BaseModel):
    """Why a file is where it is: the move the planner makes now, or why it stays."""

    file_id: int
    path: str
    tier: str
    size: int
    heat: float = Field(description="Heat now (decayed to the time of the answer)")
    wanted_tier: str
    why: str = Field(description="Why that tier, e.g. 'heat 143.2 ≥ 100.0'")
    action: str = Field(description="move or stay")
    move: PlannedMoveOut | None
    reasons: list[ReasonOut]
    model: str | None = Field(
        default=None, description="The model the file moves with, as one unit (null: alone)"
    )

    @classmethod
    def of(cls, d: Decision) -> DecisionOut:
        return cls(
            file_id=d.file_id,
            path=d.relpath,
            tier=d.tier,
            size=d.size,
            heat=d.heat,
            wanted_tier=d.wanted_tier,
            why=d.why,
            action=d.action,
            move=None if d.move is None else PlannedMoveOut.of(d.move),
            reasons=[ReasonOut(code=r.code, message=r.message, data=r.data) for r in d.reasons],
            model=d.model,
        )


class PlanExplainOut(PlanOut):
    held: list[DecisionOut] = Field(description="Files the plan leaves in place, and why")
    next_cursor: int | None = Field(description="Pass as cursor for the next page; null: done")
