"""Request and response models of the fleet routes (``/v1/fleet``): the hosts sharing this
catalog, where files and models are among them, and fleet jobs with a task per host.

A host's tiers and GPUs come from the report it wrote in its own heartbeat, perhaps by another
tierd version: they are read leniently (a field of the wrong type is dropped, not a 500).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.schemas import iso
from tiering.fleet.jobstate import JobInfo, TaskInfo
from tiering.fleet.view import FleetHost, HostPieces, HostPlace, Located
from tiering.tiers.paths import MAX_RELPATH_CHARS

__all__ = [
    "MAX_FLEET_FILES",
    "FleetFileOut",
    "FleetJobOut",
    "FleetJobsOut",
    "FleetPrefetchRequest",
    "FleetTaskOut",
    "FleetHostOut",
    "FleetHostsOut",
    "FleetTierOut",
    "GpuOut",
    "HostHoldingOut",
    "LocateOut",
    "LocatedFileOut",
    "PlaceOut",
]

State = Literal["up", "down"]


class FleetTierOut(BaseModel):
    name: str
    kind: str = Field(description="directory or object")
    rank: int = Field(description="0 is the host's fastest tier")
    shared: bool = Field(description="An object store every host that has it shares")
    files: int = Field(description="Files the catalog records there (the fleet's, if shared)")
    bytes: int


class GpuOut(BaseModel):
    device: str = Field(description="cuda:N")
    leased_bytes: int = Field(description="Bytes leased to clients on the device now")
    budget_bytes: int | None = Field(default=None, description="The most that may be leased")


class FleetHostOut(BaseModel):
    host_id: str
    address: str = Field(description="Where the host's API is reached")
    state: State = Field(description="down once its heartbeat is older than the timeout")
    started_at: float
    last_heartbeat: float
    heartbeat_age_s: float
    version: str
    tiers: list[FleetTierOut]
    gpus: list[GpuOut]
    cpu_leased_bytes: int = Field(description="Bytes leased to clients in host shared memory")

    @classmethod
    def of(cls, h: FleetHost, now: float) -> FleetHostOut:
        gpus: list[GpuOut] = []
        cpu = 0
        for d in h.gpus:
            dev, n = d.get("device"), _int_or_none(d.get("leased_bytes"))
            if not isinstance(dev, str) or n is None:
                continue
            budget = d.get("budget_bytes")
            if dev == "cpu":
                cpu = n
            elif dev.startswith("cuda"):
                gpus.append(GpuOut(device=dev, leased_bytes=n, budget_bytes=_int_or_none(budget)))
        return cls(
            host_id=h.host_id,
            address=h.address,
            state="up" if h.state == "up" else "down",
            started_at=h.started_at,
            last_heartbeat=h.last_heartbeat,
            heartbeat_age_s=max(0.0, now - h.last_heartbeat),
            version=h.version,
            tiers=[FleetTierOut(**vars(t)) for t in h.tiers],
            gpus=gpus,
            cpu_leased_bytes=cpu,
        )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_or_none(v: Any) -> int | None:
    return v if _is_int(v) else None


class FleetHostsOut(BaseModel):
    items: list[FleetHostOut] = Field(description="Every host registered, by id")
    host_timeout_s: float = Field(description="Heartbeat age past which a host is shown down")
    this_host: str = Field(description="The id of the host that answered")


class PlaceOut(BaseModel):
    host_id: str
    address: str
    state: State
    kind: Literal["memory", "tier", "copy", "object_store"] = Field(
        description="memory: a cached copy in the host's memory tier; tier: on one of its own "
        "tiers; copy: a cached copy of a shared file on one of its own directory tiers; "
        "object_store: in a shared bucket the host reads"
    )
    location: str = Field(description="The tier (or memory tier) name")
    rank: int | None = Field(description="The tier's rank on that host (None for memory)")

    @classmethod
    def of(cls, p: HostPlace) -> PlaceOut:
        return cls(
            host_id=p.host_id,
            address=p.address,
            state="up" if p.state == "up" else "down",
            kind=p.kind,  # type: ignore[arg-type]
            location=p.location,
            rank=p.rank,
        )


class HostPiecesOut(BaseModel):
    host_id: str
    address: str
    state: State
    pieces: int = Field(description="Pieces of the current generation this host has verified")
    total: int = Field(description="Pieces of the current generation")
    complete: bool = Field(description="The host has verified every piece")

    @classmethod
    def of(cls, h: HostPieces) -> HostPiecesOut:
        return cls(
            host_id=h.host_id,
            address=h.address,
            state="up" if h.state == "up" else "down",
            pieces=h.pieces,
            total=h.total,
            complete=h.pieces >= h.total,
        )


class LocatedFileOut(BaseModel):
    id: int
    path: str
    size: int
    state: str
    tier: str = Field(description="The tier of its authoritative bytes")
    host: str | None = Field(description="The host whose tier that is (None: a shared tier)")
    places: list[PlaceOut] = Field(description="Every place a host has it, warmest first")
    pieces: list[HostPiecesOut] = Field(
        default_factory=list,
        description="During a fleet distribution: each host's verified pieces of the current "
        "generation (partial while its fill runs), most first; empty when no host has recorded "
        "the generation's piece map",
    )

    @classmethod
    def of(cls, loc: Located) -> LocatedFileOut:
        r = loc.record
        return cls(
            id=r.id,
            path=r.relpath,
            size=r.size,
            state=r.state,
            tier=r.tier,
            host=r.host,
            places=[PlaceOut.of(p) for p in loc.places],
            pieces=[HostPiecesOut.of(h) for h in loc.pieces],
        )


class HostHoldingOut(BaseModel):
    """How much of what was asked for one host holds, in any place."""

    host_id: str
    state: State
    files: int
    bytes: int
    complete: bool = Field(description="The host holds every file asked for")
    warmth: Literal["memory", "tier", "object_store"] = Field(
        description="How warm the host holds all of them: the kind of its warmest place of "
        "its coldest file"
    )


class LocateOut(BaseModel):
    path: str | None = None
    model: str | None = None
    files: list[LocatedFileOut]
    hosts: list[HostHoldingOut] = Field(
        description="Hosts that hold any of the files: complete ones first, then by warmth"
    )

    @classmethod
    def of(cls, located: list[Located], **asked: str | None) -> LocateOut:
        order = {"memory": 0, "tier": 1, "copy": 1, "object_store": 2}  # a copy: on its disk
        per: dict[str, dict[str, Any]] = {}
        for loc in located:
            best: dict[str, HostPlace] = {}
            for p in loc.places:  # warmest first: the first place of a host is its best
                best.setdefault(p.host_id, p)
            for hid, p in best.items():
                h = per.setdefault(hid, {"state": p.state, "files": 0, "bytes": 0, "worst": 0})
                h["files"] += 1
                h["bytes"] += loc.record.size
                h["worst"] = max(h["worst"], order[p.kind])
        kinds = {0: "memory", 1: "tier", 2: "object_store"}
        hosts = [
            HostHoldingOut(
                host_id=hid,
                state="up" if h["state"] == "up" else "down",
                files=h["files"],
                bytes=h["bytes"],
                complete=h["files"] == len(located),
                warmth=kinds[h["worst"]],  # type: ignore[arg-type]
            )
            for hid, h in per.items()
        ]
        hosts.sort(key=lambda h: (not h.complete, h.state != "up", order[h.warmth], h.host_id))
        return cls(files=[LocatedFileOut.of(x) for x in located], hosts=hosts, **asked)


# -- fleet jobs ----------------------------------------------------------------------------------

#: Most files one fleet job names (paths asked for, or a model's files).
MAX_FLEET_FILES = 1024
#: Most hosts one request names.
MAX_FLEET_HOSTS = 1024

HostId = Annotated[str, Field(min_length=1, max_length=255)]
HostList = Annotated[list[HostId], Field(min_length=1, max_length=MAX_FLEET_HOSTS)]


class FleetPrefetchRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "oneOf": [
                {"required": ["model"], "properties": {"model": {"type": "string"}}},
                {"required": ["paths"], "properties": {"paths": {"type": "array"}}},
            ]
        },
    )

    model: str | None = Field(
        default=None,
        max_length=MAX_RELPATH_CHARS * 4,
        description="A model's directory relpath: every file in it (not with paths)",
    )
    paths: list[Annotated[str, Field(max_length=MAX_RELPATH_CHARS * 4)]] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_FLEET_FILES,
        description="Files by relpath (not with model)",
    )
    hosts: HostList | Literal["all"] = Field(
        default="all", description='Host ids, each up now, or "all": every host up now'
    )
    target: Literal["gpu", "memory", "nvme", "page_cache"] = Field(
        description="What each host does, as POST /v1/prefetch: gpu (a warm read-only lease), "
        "memory (its memory tier), nvme (its fastest tier), page_cache (read through)"
    )
    device: str | None = Field(
        default=None,
        max_length=32,
        pattern=r"^(cpu|cuda:[0-9]{1,3})$",
        description="For gpu: cuda:N (default cuda:0) or cpu, on every host",
    )

    @model_validator(mode="after")
    def _one(self) -> Any:
        if (self.model is None) == (self.paths is None):
            raise ValueError("give exactly one of model and paths")
        if self.device is not None and self.target != "gpu":
            raise ValueError(f"device applies to target gpu only, not {self.target}")
        return self


def _progress(done: int, total: int) -> float:
    return round(done / total, 6) if total else 1.0


class FleetTaskOut(BaseModel):
    """One host's part of a fleet job."""

    host: str
    state: Literal["queued", "running", "done", "failed", "cancelled"]
    attempts: int = Field(
        description="How many times the host claimed it (a re-run after a restart is one more)"
    )
    claimed_by: str | None
    claim_expires: datetime | None = Field(
        description="When the claim lapses unless the host renews it (it does while it works)"
    )
    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int
    progress: float = Field(description="bytes_done / bytes_total (1 when there are no bytes)")
    error: str | None = Field(description="Why the task failed, for a person")
    errors: list[dict[str, Any]] = Field(description="Files that failed on this host, and why")
    sources: dict[str, int] = Field(
        description="Bytes this host's copies took from each source: bucket, peer:<host>"
    )
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime

    @classmethod
    def of(cls, t: TaskInfo) -> FleetTaskOut:
        return cls(
            host=t.host,
            state=t.state,  # type: ignore[arg-type]
            attempts=t.attempts,
            claimed_by=t.claimed_by,
            claim_expires=iso(t.claim_expires),
            files_done=t.files_done,
            files_total=t.files_total,
            bytes_done=t.bytes_done,
            bytes_total=t.bytes_total,
            progress=_progress(t.bytes_done, t.bytes_total),
            error=t.error,
            errors=t.errors,
            sources=t.sources,
            started_at=iso(t.started_at),
            finished_at=iso(t.finished_at),
            updated_at=iso(t.updated_at),  # type: ignore[arg-type]
        )


class FleetFileOut(BaseModel):
    id: int
    path: str
    size: int = Field(description="Its size when the job was created")


class FleetJobOut(BaseModel):
    id: int
    kind: str = Field(description="prefetch")
    target: str
    device: str | None
    model: str | None
    state: Literal["queued", "running", "done", "failed", "cancelled"] = Field(
        description="From the hosts' tasks: done when every one is; failed when any failed and "
        "none is still open; cancelled; running once any started; else queued"
    )
    created_by: str = Field(description="The host that took the request")
    created_at: datetime
    cancelled_at: datetime | None
    finished_at: datetime | None
    files_done: int = Field(description="Summed over the hosts")
    files_total: int
    bytes_done: int
    bytes_total: int
    progress: float = Field(description="bytes_done / bytes_total over every host")
    hosts: list[FleetTaskOut] = Field(description="Each host's task, by host id")
    files: list[FleetFileOut] = Field(description="What every host warms")

    @classmethod
    def of(cls, j: JobInfo) -> FleetJobOut:
        files = j.spec.get("files")
        done, total = j.total("bytes_done"), j.total("bytes_total")
        return cls(
            id=j.id,
            kind=j.kind,
            target=j.target,
            device=_str_or_none(j.spec.get("device")),
            model=_str_or_none(j.spec.get("model")),
            state=j.state,  # type: ignore[arg-type]
            created_by=j.created_by,
            created_at=iso(j.created_at),  # type: ignore[arg-type]
            cancelled_at=iso(j.cancelled_at),
            finished_at=iso(j.finished_at),
            files_done=j.total("files_done"),
            files_total=j.total("files_total"),
            bytes_done=done,
            bytes_total=total,
            progress=_progress(done, total),
            hosts=[FleetTaskOut.of(t) for t in j.tasks],
            files=[
                FleetFileOut(id=f["id"], path=f["path"], size=f["size"])
                for f in (files if isinstance(files, list) else [])
                if isinstance(f, dict)
            ],
        )


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) else None


class FleetJobsOut(BaseModel):
    items: list[FleetJobOut] = Field(description="Newest first")
    next_cursor: int | None = Field(description="Pass as cursor for the next page; None at the end")
