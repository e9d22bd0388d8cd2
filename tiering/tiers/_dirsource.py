"""What a directory tier's ``open`` returns: a plain file read through its fd, or a container
(one of tierd's compressed files, kept under the tier's ``.tierd-compressed/`` directory) read
as the logical file it holds.

A source knows two directories: ``tier``, the tier it is a file of (its name, its pools), and
``place``, the directory tier whose root holds the bytes (the tier itself, or for a container
its ``.tierd-compressed`` place), which is where "the path still names this file" is checked.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Protocol

from tiering.codec import Container
from tiering.ranges import RangeReader, Rings, read_ahead
from tiering.tiers._base import LocalFile, Source, Stat
from tiering.tiers._compressed import CompressedRanges, logical_stat
from tiering.tiers._dirwriter import pread_exact, stat_of

__all__ = ["CompressedSource", "DirectorySource"]


class DirectoryTier(Protocol):
    """What a source needs of its directory tier and of the place holding its bytes (a
    Protocol: the tier's module imports this one)."""

    name: str
    root: Path

    def lstat(self, relpath: str) -> Stat | None: ...

    def decode_pool(self) -> Executor: ...


class DirectorySource(Source):
    """A file opened beneath a directory tier; reads go through its fd."""

    def __init__(
        self,
        tier: DirectoryTier,
        relpath: str,
        fd: int,
        st: os.stat_result,
        place: DirectoryTier | None = None,
    ) -> None:
        self.tier = tier
        self.place = place or tier
        self.relpath = relpath
        self.fd = fd
        self.st = st
        self.disk = self.stat = stat_of(st)  # the file on disk (a compressed one's differs)

    def local_file(self) -> LocalFile | None:
        return LocalFile(self.fd, self.place.root / self.relpath) if self.fd >= 0 else None

    def readinto(self, buf: memoryview, offset: int) -> int:
        return self._pread_into(buf, offset)

    def _pread_into(self, view: memoryview, offset: int) -> int:
        """The file's bytes at ``offset`` into ``view`` (fewer only at its end)."""
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                break
            done += got
        return done

    def chunks(self, chunk_size: int) -> Iterator[memoryview]:
        with contextlib.suppress(OSError):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return super().chunks(chunk_size)

    def unchanged(self) -> bool:
        """The fd's file is unchanged and the path still names it."""
        if self.fd < 0:
            return False
        now = stat_of(os.fstat(self.fd))
        at_path = self.place.lstat(self.relpath)
        return now.same_file(self.disk) and at_path is not None and at_path.same_file(self.disk)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class CompressedSource(DirectorySource):
    """A container of a directory tier, read as its logical bytes (see
    :mod:`tiering.tiers._compressed`): no local file, a decoding range reader."""

    def __init__(
        self,
        tier: DirectoryTier,
        relpath: str,
        fd: int,
        st: os.stat_result,
        c: Container,
        place: DirectoryTier | None = None,
    ) -> None:
        super().__init__(tier, relpath, fd, st, place)
        # Chunks are read through the source's fd as it is at each read: once the source is
        # closed a late read fails (EBADF) rather than read whatever file took the number.
        self.container = c.reading(self._pread, self._pread_into)
        self.stat = logical_stat(self.disk, c.size)
        self._ranges = CompressedRanges(self.container, self.disk.version, tier.decode_pool())

    def local_file(self) -> LocalFile | None:
        return None

    def stored_file(self) -> LocalFile | None:
        return LocalFile(self.fd, self.place.root / self.relpath) if self.fd >= 0 else None

    @property
    def ranges(self) -> RangeReader | None:
        return self._ranges

    def readinto(self, buf: memoryview, offset: int) -> int:
        return self.container.readinto(buf, offset)

    def _pread(self, n: int, offset: int) -> bytes:
        return pread_exact(self.fd, n, offset)

    def chunks(self, chunk_size: int) -> Iterator[memoryview]:
        """In order, with the next chunks decoding on the tier's pool meanwhile (a move or a
        memory fill writes one while the cores decode the next)."""
        ahead = min(os.cpu_count() or 1, 4) * self.container.chunk_size
        return read_ahead(self._ranges, chunk_size, readahead_bytes=ahead, rings=Rings(0))
