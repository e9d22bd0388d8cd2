"""What the repository is told about bytes placed on a tier, and what it reports of a tier."""

from __future__ import annotations

from dataclasses import dataclass

from tiering.catalog.models import FileRecord, FileState

__all__ = ["NewFile", "TierUsage", "is_same_content"]


@dataclass(frozen=True)
class NewFile:
    """What the catalog needs to know about bytes just placed on a tier."""

    relpath: str
    tier: str
    size: int
    mtime_ns: int
    checksum: str | None
    etag: str | None = None
    #: How the tier stores them, where not as they are (see ``FileRecord.codec``).
    codec: str | None = None
    stored_size: int | None = None


def is_same_content(rec: FileRecord, new: NewFile) -> bool:
    """``new`` describes exactly the bytes ``rec`` already records, as a stable file."""
    return (
        rec.state == FileState.STABLE
        and (rec.tier, rec.size, rec.mtime_ns, rec.checksum, rec.etag)
        == (new.tier, new.size, new.mtime_ns, new.checksum, new.etag)
        and (new.checksum is not None or new.etag is not None)
    )


@dataclass(frozen=True)
class TierUsage:
    """Files and bytes on one tier: ``bytes`` logical, ``stored`` what they take there."""

    files: int
    bytes: int
    stored: int
