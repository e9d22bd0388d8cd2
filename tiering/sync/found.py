"""What the catalog records of a file a scan found in a tier: hashed (a local file), or taken
from its listing (an object), and which version of it an entry is."""

from __future__ import annotations

from tiering.catalog import NewFile
from tiering.checksum import CHUNK, Hasher
from tiering.integrity import version_of
from tiering.tiers import Source, Tier, WalkEntry

__all__ = ["entry_version", "listed_record", "record_of"]


def record_of(tier: Tier, relpath: str) -> NewFile:
    """What the catalog records of a file found in ``tier``.

    A local file is hashed. An object is not read: its ETag names the version, a checksum
    stored by tierd in its metadata is taken as is, and otherwise the first move that reads
    its bytes records their checksum (the move hashes as it copies).
    """
    with tier.open(relpath) as src:
        st = src.stat
        checksum = _checksum(src) if tier.capabilities.local_files else st.checksum
    return NewFile(
        relpath, tier.name, st.size, st.mtime_ns, checksum, st.etag, st.codec, st.stored_size
    )


def entry_version(entry: WalkEntry) -> str:
    """Which version of a file an entry is, as the damage log tells them apart."""
    return version_of(entry.size, entry.mtime_ns, entry.etag)


def _checksum(src: Source) -> str:
    """Checksum of the source's first ``size`` bytes: those its stat (the record) describes."""
    h = Hasher()
    buf = memoryview(bytearray(min(CHUNK, src.size)))
    offset = 0
    while offset < src.size:
        n = src.readinto(buf[: min(CHUNK, src.size - offset)], offset)
        if n == 0:
            break
        h.update(buf[:n])
        offset += n
    return h.value()


def listed_record(tier: Tier, entry: WalkEntry) -> NewFile | None:
    """The record of an object adopted straight from its listing (no request per object)."""
    if entry.etag is None or entry.codec is not None:
        return None  # no version to pin, or a compressed object: its logical size is inside
    return NewFile(entry.relpath, tier.name, entry.size, entry.mtime_ns, None, entry.etag)
