"""Where a memory fill's bytes come from: this host's copy of a fleet's shared file, made from
the fleet's pieces where there is none; else a peer's whole copy; else the file's own tier.

On a fleet (a catalog several hosts share, with the piece exchange on), a memory fill of a
shared file takes its bytes through this host's copy of it on a directory tier
(:class:`~tiering.copies.HostCopies`): a current copy is read where there is one, else one is
made (or the copy's fill in flight joined) from 8 MiB pieces exchanged with the other hosts,
the bucket claimed only for pieces no peer has. So N hosts filling their memory with one model
at once make the bucket send it about once, as their copies on disk do. Reading a peer's
*whole* copy first, as loads do, would leave each of them to read the bucket: while they all
fill, none holds it whole. The copy on disk is a cache too (kept the fill's ``keep_s``, then
for its heat; a crash leaves at worst a temp that recovery sweeps), and it relays its verified
pieces to the fleet while it fills and after.

A host with no tier that can hold copies (or no room for one, or no fleet credential) reads a
peer's whole copy, else the bucket, as before; the first case is logged once, as a warning.
Every source's bytes are checked by the caller against the catalog's checksum.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from tiering.catalog import FileRecord
from tiering.copies.hostcopies import HostCopies
from tiering.errors import FileChanged, InsufficientSpace, StorageError
from tiering.moves import FileOps
from tiering.tiers import LocalFile, Source, Stat

__all__ = ["FillProgress", "FillSource"]

log = logging.getLogger(__name__)

#: Where bytes of a fill came from (``bucket``, ``peer:<host>``), and how many.
Sources = Callable[[str, int], None]


class FillProgress:
    """A fill's progress in bytes of the file, reported to ``to`` at most ``size`` in all: a
    shared file's bytes are copied twice (onto disk, then into memory), and whichever copy
    moves them first reports them."""

    def __init__(self, size: int, to: Callable[[int], None] | None) -> None:
        self._left, self._to = size, to

    def __call__(self, n: int) -> None:
        n = min(n, self._left)
        if n > 0 and self._to is not None:
            self._left -= n
            self._to(n)


class FillSource:
    """Opens a file's bytes for a memory fill; see the module docstring.

    Parameters
    ----------
    name:
        The memory tier's name (for the log).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        #: The engine's file operations (the file's own tier), once the catalog is open.
        self.files: FileOps | None = None
        #: This host's copies of the fleet's shared files (None: it keeps none).
        self.host_copies: HostCopies | None = None
        #: Another host's verified whole copy of a shared file (None: no peer holds it).
        self.peer_source: Callable[[FileRecord], Source | None] | None = None
        self._said_no_copies = False

    def open(
        self,
        rec: FileRecord,
        *,
        stop: threading.Event,
        progress: FillProgress,
        throttle: bool,
        keep_s: float,
        sources: Sources | None,
    ) -> Source:
        """``rec``'s bytes at its generation, opened for reading (the caller closes them and
        checks them against the catalog's checksum).

        ``stop``, ``progress``, ``throttle``, ``keep_s`` and ``sources`` apply to the copy
        on disk a shared file's fill makes (see :meth:`HostCopies.fill`).

        Raises
        ------
        FileChanged, IntegrityError
            The file changed, or its pieces' bytes were not the catalog's.
        FillCancelled
            ``stop`` was set while the copy on disk was made.
        """
        source = self._host_copy(rec, stop, progress, throttle, keep_s, sources)
        return source if source is not None else self._whole(rec, sources)

    def _host_copy(
        self,
        rec: FileRecord,
        stop: threading.Event,
        progress: FillProgress,
        throttle: bool,
        keep_s: float,
        sources: Sources | None,
    ) -> Source | None:
        """This host's current copy of a fleet's shared file, opened, made first from the
        fleet's pieces where there is none; None where the file is not shared, the host keeps
        no copies, or no copy could be made (logged)."""
        hc = self.host_copies
        if hc is None or not hc.is_origin(rec.tier):
            self._say_no_copies(rec)
            return None
        source = hc.open(rec)
        if source is not None or hc.fleet is None or not hc.holders:
            return _copy_of(rec, source)  # no piece exchange (no credential): none made for it
        tier = hc.holders[0].name  # the fastest: where a prefetch to nvme puts its copy too
        try:
            hc.fill(
                rec.id,
                tier,
                cancel=stop,
                progress=progress,
                throttle=throttle,
                keep_s=keep_s,
                sources=sources,
            )
        except (InsufficientSpace, StorageError) as exc:
            # The copy on disk is the way to the pieces, not the goal: without one the bytes
            # still come, from a peer's whole copy or the bucket.
            log.info("memory tier %s: %s; reading it whole instead", self.name, exc.message)
            return None
        return _copy_of(rec, hc.open(rec))  # None: dropped or changed meanwhile (read whole)

    def _say_no_copies(self, rec: FileRecord) -> None:
        """Log once that this fleet host's fills of shared files cannot use the pieces."""
        if self._said_no_copies or self.peer_source is None or self.host_copies is not None:
            return
        if self.files is None or not self.files.tiers.get(rec.tier).capabilities.shared:
            return
        self._said_no_copies = True
        log.warning(
            "memory tier %s: this host has no tier that can hold copies of the fleet's shared "
            "files, so its memory fills of them take no pieces from peers: each reads a peer's "
            "whole copy, else the whole file from the bucket (give it a directory tier)",
            self.name,
        )

    def _whole(self, rec: FileRecord, sources: Sources | None) -> Source:
        """``rec``'s bytes read whole: a peer's verified copy first, else its tier's."""
        if self.files is None:
            raise RuntimeError("the memory tier is not bound to a catalog")
        source = self.peer_source(rec) if self.peer_source is not None else None
        if source is not None:
            return source
        content = self.files.open_content(rec.id)
        if content.record.generation != rec.generation:
            content.source.close()
            raise FileChanged(f"{rec.relpath!r} changed before it was copied into memory")
        if sources is not None and self.files.tiers.get(rec.tier).capabilities.shared:
            sources("bucket", rec.size)
        return content.source


def _copy_of(rec: FileRecord, copy: Source | None) -> Source | None:
    return None if copy is None else _CopyOfOrigin(rec, copy)


class _CopyOfOrigin(Source):
    """This host's copy of a shared file as a source of the origin's object: its bytes are the
    copy's, its stat the object's (the catalog's ETag), so a copy made from it is current for
    as long as the object is, as one read from the bucket or a peer is. It owns ``copy``."""

    def __init__(self, rec: FileRecord, copy: Source) -> None:
        self.relpath = rec.relpath
        self.stat = Stat(
            size=rec.size,
            mtime_ns=rec.mtime_ns,
            version=rec.etag or "",
            checksum=rec.checksum,
            etag=rec.etag,
        )
        self._copy = copy

    def local_file(self) -> LocalFile | None:
        return self._copy.local_file()

    def readinto(self, buf: memoryview, offset: int) -> int:
        return self._copy.readinto(buf, offset)

    def chunks(self, chunk_size: int) -> Iterator[memoryview]:
        return self._copy.chunks(chunk_size)

    def unchanged(self) -> bool:
        # A copy's name is never rewritten (a new generation is a new name): the copy's answer.
        return self._copy.unchanged()

    def close(self) -> None:
        self._copy.close()
