"""nvCOMP's batched Zstd decoder through its C API (``libnvcomp.so.6``, from the
``nvidia-libnvcomp-cu13`` wheel or the system).

Why the C API and not nvCOMP's Python module: its ``Codec.decode`` holds the GIL until the
decode is done on the GPU, so the threads that read the next batch's bytes on the host stood
still meanwhile (measured on an H100: reads and decodes each ran at ~30 GB/s, together at 16).
Through ctypes the call releases the GIL and is only queued on the stream; the per-frame
statuses and sizes are copied back on the same stream and checked once it is synchronized.
"""

from __future__ import annotations

import ctypes
import importlib
import threading

__all__ = ["Zstd", "load"]


class _DecompressOpts(ctypes.Structure):
    # nvcompBatchedZstdDecompressOpts_t: the backend (0: nvCOMP chooses), 60 zero bytes.
    _fields_ = [("backend", ctypes.c_int), ("reserved", ctypes.c_char * 60)]


_SIZE = ctypes.c_size_t
_PTR = ctypes.c_void_p
_lock = threading.Lock()
_loaded: tuple[Zstd | None, str | None] | None = None


class Zstd:
    """The two entry points tierd uses, bound with their C signatures."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._temp = lib.nvcompBatchedZstdDecompressGetTempSize
        self._temp.argtypes = [_SIZE, _SIZE, _DecompressOpts, ctypes.POINTER(_SIZE), _SIZE, _PTR]
        self._temp.restype = ctypes.c_int
        self._decode = lib.nvcompBatchedZstdDecompressAsync
        self._decode.argtypes = [_PTR, _PTR, _PTR, _PTR, _SIZE, _PTR, _SIZE, _PTR, _DecompressOpts]
        self._decode.argtypes += [_PTR, _PTR]
        self._decode.restype = ctypes.c_int
        self._opts = _DecompressOpts(0)

    def temp_bytes(self, frames: int, max_frame: int, total: int) -> int:
        """Device scratch a call of up to ``frames`` frames (each at most ``max_frame``
        bytes decoded, ``total`` in all) needs."""
        out = _SIZE(0)
        status = self._temp(frames, max_frame, self._opts, ctypes.byref(out), total, None)
        if status != 0:
            raise RuntimeError(f"nvcompBatchedZstdDecompressGetTempSize failed ({status})")
        return int(out.value)

    def decompress_async(
        self,
        *,
        src_ptrs: int,
        src_bytes: int,
        dst_bytes: int,
        actual_bytes: int,
        frames: int,
        temp: int,
        temp_bytes: int,
        dst_ptrs: int,
        statuses: int,
        stream: int,
    ) -> None:
        """Queue the decode of ``frames`` frames on ``stream``; every argument but the counts
        is a device address (arrays of ``frames`` pointers, sizes and statuses)."""
        status = self._decode(
            src_ptrs,
            src_bytes,
            dst_bytes,
            actual_bytes,
            frames,
            temp,
            temp_bytes,
            dst_ptrs,
            self._opts,
            statuses,
            stream,
        )
        if status != 0:
            raise RuntimeError(f"nvcompBatchedZstdDecompressAsync could not start ({status})")


def load() -> tuple[Zstd | None, str | None]:
    """nvCOMP's Zstd decoder, or None and why not (asked once a process)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> tuple[Zstd | None, str | None]:
    lib: ctypes.CDLL | None = None
    errors = []
    try:  # the wheel's copy (nvidia-libnvcomp-cu13)
        lib = importlib.import_module("nvidia.libnvcomp").load_library()
    except Exception as exc:
        errors.append(str(exc))
    if lib is None:
        try:
            lib = ctypes.CDLL("libnvcomp.so.6")
        except OSError as exc:
            errors.append(str(exc))
    if lib is None:
        return None, f"nvCOMP's library is not installed ({'; '.join(errors) or 'not found'})"
    try:
        return Zstd(lib), None
    except AttributeError as exc:
        return None, f"this libnvcomp lacks the batched Zstd decoder ({exc})"
