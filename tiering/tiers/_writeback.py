"""Start the kernel writing a file's dirty pages while the file is still being written.

A move or an upload ends with ``fsync``. Left alone, Linux writes dirty pages back only past
``dirty_background_ratio`` of RAM (gigabytes on a GPU host), so a 1 GiB copy first fills the
page cache and then waits for the whole flush: the time is read + flush. Asking for writeback
of each written step as the copy goes (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, what
RocksDB's ``bytes_per_sync`` does) overlaps the two, and the final ``fsync`` finds little left.

It is only a hint: it makes nothing durable (``fsync`` stays the commit of the bytes) and its
failures are ignored, as ``fsync`` reports any real one. Where the call does not exist
(not Linux, or a libc without it) :func:`start_writeback` does nothing.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

__all__ = ["WRITEBACK_STEP", "start_writeback"]

#: Bytes written between two writeback requests.
WRITEBACK_STEP = 16 << 20
_SYNC_FILE_RANGE_WRITE = 2

_lock = threading.Lock()
_fn: list[Any] = []  # [] until resolved, then [function or None]


def _resolve() -> Any:
    with _lock:
        if not _fn:
            fn = None
            if sys.platform.startswith("linux"):
                try:
                    fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
                    fn.restype = ctypes.c_int
                except (OSError, AttributeError):
                    fn = None
            _fn.append(fn)
        return _fn[0]


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to its device."""
    fn = _resolve()
    if fn is not None and nbytes > 0:
        fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
