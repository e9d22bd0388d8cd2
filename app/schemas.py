"""Request and response models of the REST API."""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel, Field

from tiering.catalog import FileRecord
from tiering.engine import TierInfo

__all__ = ["FileList", "FileOut", "TierOut", "iso"]


def iso(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


class FileOut(BaseModel):
    id: int
    path: str
    tier: str
    size: int
    checksum: str | None
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
    name: str
    rank: int
    path: str
    capacity_bytes: int
    used_bytes: int = Field(description="Bytes in use on the filesystem, by anyone")
    free_bytes: int
    quota_bytes: int | None
    files: int = Field(description="Files the catalog places on this tier")
    file_bytes: int = Field(description="Bytes of those files")

    @classmethod
    def of(cls, t: TierInfo) -> TierOut:
        return cls(
            name=t.name,
            rank=t.rank,
            path=t.path,
            capacity_bytes=t.space.total,
            used_bytes=t.space.used,
            free_bytes=t.space.free,
            quota_bytes=t.quota_bytes,
            files=t.files,
            file_bytes=t.used_bytes,
        )
