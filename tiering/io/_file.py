""":class:`GdsFile`: an open file, the tier it lies on, and its backend handle."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from tiering.closing import Closing
from tiering.errors import ClosedFile
from tiering.tiers import pread_exact

from ._stats import UNTIERED, IoPath

__all__ = ["GdsFile"]


class _Guard:
    """``with file.guard() as fd``: a class, not a generator, as 4 KiB reads feel the cost."""

    __slots__ = ("_file",)

    def __init__(self, file: GdsFile) -> None:
        self._file = file

    def __enter__(self) -> int:
        f = self._file
        with f._cond:
            if f._closed:
                raise ClosedFile(f"{f.path} is closed", path=str(f.path))
            f._in_flight += 1
        return f._fd

    def __exit__(self, *exc: object) -> None:
        f = self._file
        with f._cond:
            f._in_flight -= 1
            if f._in_flight == 0:
                f._cond.notify_all()


class GdsFile(Closing):
    """A file opened by :meth:`GpuDirectStorage.open_file <tiering.io.GpuDirectStorage.open_file>`.

    It holds a read-only descriptor, the backend's handle (a KvikIO ``CuFile`` on GPU hosts)
    and, once a gather needs it, a read-only memory map. Use it as a context manager, or call
    :meth:`close`; operations on a closed file raise :class:`~tiering.errors.ClosedFile`.
    Closing waits for reads already in flight on other threads.
    """

    def __init__(
        self,
        path: Path,
        fd: int,
        size: int,
        *,
        tier: str | None,
        rank: int | None,
        alignment: int,
        handle: Any,
        io_path: IoPath,
        owner: object,
    ) -> None:
        self.path = path
        self.tier = tier
        self.rank = rank
        self.io_path: IoPath = io_path
        """The path reads of this file take into the storage's device."""
        self._fd = fd
        self._size = size
        self._alignment = alignment
        self._handle = handle
        self._owner = owner
        self._map: mmap.mmap | None = None
        self._cond = threading.Condition()
        self._in_flight = 0
        self._closed = False

    def size(self) -> int:
        """Size of the file in bytes when it was opened."""
        return self._size

    def is_aligned(self) -> bool:
        """Whether the size is a multiple of the direct-I/O alignment (4096 by default).

        Direct reads of an aligned file never need a bounce buffer for a partial last page.
        """
        return self._size % self._alignment == 0

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def tier_key(self) -> str:
        """The tier name used in stats (``"untiered"`` outside every tier root)."""
        return self.tier if self.tier is not None else UNTIERED

    def guard(self) -> _Guard:
        """Guard one operation on the file: ``with file.guard() as fd`` gives its descriptor
        (-1 for a remote file) and delays :meth:`close` until the block ends.

        Raises
        ------
        ClosedFile
            The file is closed.
        """
        return _Guard(self)

    def identity(self) -> tuple[int, ...]:
        """What tells this open file's bytes from another's: ``(st_dev, st_ino, st_mtime_ns)``
        of a local file; ``()`` for a remote object (pinned to its ETag) or a held copy
        (pinned to its generation). Opens of one file that agree got the same bytes."""
        with self.guard() as fd:
            if fd < 0:
                return ()
            st = os.fstat(fd)
        return (st.st_dev, st.st_ino, st.st_mtime_ns)

    def _rows(self, populate: bool) -> np.ndarray:
        """The file as a flat read-only ``uint8`` array over a shared memory map.

        ``populate`` maps every page up front (MAP_POPULATE): on a file that is in the page
        cache this costs a one-time walk and saves a page fault per gathered row later.
        """
        with self._cond:
            if self._map is None:
                flags = mmap.MAP_SHARED
                if populate and hasattr(mmap, "MAP_POPULATE"):
                    flags |= mmap.MAP_POPULATE
                self._map = mmap.mmap(self._fd, self._size, flags=flags, prot=mmap.PROT_READ)
                if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_RANDOM"):
                    # Gathers jump around; read-ahead around each fault would be wasted I/O.
                    self._map.madvise(mmap.MADV_RANDOM)
            return np.frombuffer(self._map, dtype=np.uint8)

    def close(self) -> None:
        """Close the file; waits for operations in flight. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            while self._in_flight:
                self._cond.wait()
            handle, self._handle = self._handle, None
            mapping, self._map = self._map, None
        if handle is not None:
            handle.close()
        if mapping is not None:
            with contextlib.suppress(BufferError):
                # Arrays handed out still view it; the map then closes when they are freed.
                mapping.close()
        self._release()

    def _release(self) -> None:
        """Free what the file reads through (its descriptor), once no read is in flight."""
        os.close(self._fd)

    def read_bytes(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer only at the end), for small metadata reads
        such as a safetensors header. Call it inside ``_use()``."""
        return pread_exact(self._fd, n, offset)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<GdsFile {str(self.path)!r} size={self._size} tier={self.tier_key} "
            f"io_path={self.io_path} {state}>"
        )

    def __del__(self) -> None:
        # A forgotten file must not leak its descriptor; close() is the supported way.
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.close()
