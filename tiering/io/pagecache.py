"""Page-cache residency (``mincore``) and eviction (``posix_fadvise``) of a file range.

Residency decides between the hot and the cold read settings: a warm file wants many
threads, a cold one a few large requests. Linux only; elsewhere residency reads as 1.0
(everything treated as hot), which only costs speed, never correctness.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os
import sys

__all__ = ["drop", "residency"]

_PAGE = mmap.PAGESIZE
_libc: ctypes.CDLL | None = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        _libc = None

_MAP_FAILED = ctypes.c_void_p(-1).value
# mincore() costs ~50 ns per page (a page-cache lookup each): 50 ms for a 4 GiB file, as much
# as reading it hot. So look at this many evenly spread windows of a few pages instead.
_WINDOWS = 64
_WINDOW_PAGES = 8


def residency(fd: int, offset: int, length: int) -> float:
    """Fraction (0..1) of the pages of ``[offset, offset + length)`` in the page cache.

    Estimated from a sample of at most 512 pages: enough to tell hot from cold.
    """
    if _libc is None or length <= 0:
        return 1.0
    start = offset - offset % _PAGE
    span = offset + length - start
    npages = (span + _PAGE - 1) // _PAGE
    addr = _libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr in (None, _MAP_FAILED):
        return 1.0
    try:
        if npages <= _WINDOWS * _WINDOW_PAGES:
            windows = [(0, npages)]
        else:
            step = npages // _WINDOWS
            windows = [(i * step, _WINDOW_PAGES) for i in range(_WINDOWS)]
        vec = (
            (ctypes.c_ubyte * _WINDOW_PAGES)() if len(windows) > 1 else (ctypes.c_ubyte * npages)()
        )
        hits = total = 0
        for first, count in windows:
            if _libc.mincore(addr + first * _PAGE, count * _PAGE, vec) != 0:
                return 1.0
            hits += sum(b & 1 for b in vec[:count])
            total += count
        return hits / total
    finally:
        _libc.munmap(addr, span)


def drop(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to evict the clean cached pages of a range (no privileges needed)."""
    if hasattr(os, "posix_fadvise"):
        if _is_writable(fd):
            os.fdatasync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _is_writable(fd: int) -> bool:
    return (fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE) != os.O_RDONLY
