"""Copies of a file's bytes already in memory, and how a load picks one.

Two holders keep such copies: the memory tier (pinned host memory, a cache of files whose
authoritative bytes stay on a storage tier) and the GPU residency of the loader (read-only
device allocations that shared loads and GPU prefetches hand out). Both answer one question
through :class:`Holder`: "do you hold this file, at this generation, for a read into this
device?" The answer is a :class:`Held` copy, which the holder keeps unchanged (never evicted,
never reused) until it is released.

A copy is named by its content: file id and catalog generation (every change of place or
content bumps it), and the :class:`~tiering.tiers.Stat` of the authoritative file when it was
copied. :func:`still_current` checks that stat again for a file of a local directory tier, so
even a file rewritten behind tierd's back (before the watcher has told the catalog) is never
served from a stale copy. An object-store tier's copy is checked by its ETag against the
catalog's, as every load of such a tier is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tiering.catalog import FileRecord
from tiering.errors import TierdError
from tiering.io import Device
from tiering.tiers import Stat, Tier

__all__ = ["Held", "Holder", "authoritative_stat", "still_current"]


@dataclass
class Held:
    """One copy of a whole file, pinned by its holder until :meth:`release`.

    ``array`` is a flat ``uint8`` array of the file's bytes, on the host (``held_on`` ``cpu``)
    or on a GPU, after ``head``: the file's first bytes, kept apart in host memory where the
    copy on the device is of the rest only (a safetensors shard's tensors, whose header the
    load that made the copy had read); ``stat`` is the authoritative file's when it was copied.
    """

    file_id: int
    generation: int
    stat: Stat
    array: Any
    held_on: Device
    holder: str  # the memory tier's name, or "gpu"
    head: bytes = b""
    _release: Callable[[], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Let the holder evict or reuse the copy again. Idempotent."""
        release, self._release = self._release, None
        if release is not None:
            release()


class Holder(Protocol):
    """Something that may hold copies of files in memory."""

    def acquire(self, rec: FileRecord, device: Device) -> Held | None:
        """The best copy of ``rec`` (its id and generation) for a read into ``device``, pinned
        until released; None when there is none."""
        ...


def still_current(held: Held, rec: FileRecord, tier: Tier) -> bool:
    """Whether ``held`` is still a copy of what ``rec`` names: same generation and, for a
    tier whose reads are not pinned to the catalog's ETag, the same file on disk now (inode,
    size and time)."""
    if held.generation != rec.generation or held.stat.size != rec.size:
        return False
    if tier.capabilities.pinned_reads:
        return (held.stat.etag or None) == (rec.etag or None)
    try:
        now = tier.stat(rec.relpath)
    except TierdError:
        return False
    return now is not None and now.same_file(held.stat)


def authoritative_stat(rec: FileRecord, tier: Tier) -> Stat | None:
    """The authoritative file now, taken *before* reading bytes that become a resident copy.

    A change after this stat shows in a later one (a new inode, size or time), so the copy is
    never served stale. None when the file on disk is not the one the catalog records (gone, or
    another size): such a read is not kept. An object-store tier's copy is checked by the ETag
    the catalog recorded, which every load of it is pinned to.
    """
    if tier.capabilities.pinned_reads:
        return Stat(size=rec.size, mtime_ns=0, version=rec.etag or "", etag=rec.etag)
    try:
        now = tier.stat(rec.relpath)
    except TierdError:
        return None
    return now if now is not None and now.size == rec.size else None
