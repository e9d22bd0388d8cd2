"""Page-locked host memory for the memory tier, and the host's memory budget.

Each cached file is one allocation, made once when the file is copied in and reused by every
load until the copy is dropped. Page-locked, so a load into a GPU is pure DMA at the link's
rate, and the kernel never swaps it out from under a load:

- on a host with CUDA, ``cudaHostAlloc`` (``cupy.cuda.PinnedMemory``, portable to every
  device's context). Not CuPy's pinned memory *pool*, which keeps every block it ever handed
  out: a dropped copy must give its memory back to the host;
- without CUDA, an anonymous ``mmap`` locked with ``mlock``, which the kernel bounds by
  ``RLIMIT_MEMLOCK`` unless the process has ``CAP_IPC_LOCK`` (the NVIDIA driver pins its own
  allocations and is not bound by it).

:func:`check_budget` compares a memory tier's quota with that limit and with the host's RAM
at start, so a tier that cannot be honoured fails with its numbers and the fix, not later with
a failed allocation.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import resource
from pathlib import Path
from typing import Any

import numpy as np

from tiering.errors import InsufficientSpace, TierUnavailable

__all__ = [
    "HostAllocation",
    "allocate",
    "check_budget",
    "default_floor",
    "memlock_limit",
    "meminfo",
    "pinning_backend",
]

log = logging.getLogger(__name__)

GiB = 1 << 30
_CAP_IPC_LOCK = 14  # linux/capability.h
_HOST_ALLOC_PORTABLE = 1  # cudaHostAllocPortable: pinned for every CUDA context, not just one


def meminfo(path: str | Path = "/proc/meminfo") -> dict[str, int]:
    """The host's memory counters in bytes (``MemTotal``, ``MemAvailable``...)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                scale = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
                out[key] = int(parts[0]) * scale
    return out


def default_floor(mem_total: int) -> int:
    """MemAvailable below which the memory tier gives memory back: max(1 GiB, 5 % of RAM)."""
    return max(GiB, mem_total // 20)


def _has_ipc_lock(status: str | Path = "/proc/self/status") -> bool:
    with contextlib.suppress(OSError, ValueError), open(status) as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    return False


def memlock_limit() -> int | None:
    """Bytes this process may ``mlock``; None when it is not limited (``RLIMIT_MEMLOCK``
    unlimited, or the process holds ``CAP_IPC_LOCK``)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or _has_ipc_lock():
        return None
    return int(soft)


@functools.cache
def pinning_backend() -> str:
    """``"cuda"`` where CuPy sees a GPU, else ``"mlock"`` (asked once per process)."""
    try:
        import cupy

        if int(cupy.cuda.runtime.getDeviceCount()) > 0:
            return "cuda"
        reason = "CuPy sees no GPU"
    except Exception as exc:  # no CuPy, no driver, no device: all mean the same here
        reason = f"no CUDA ({type(exc).__name__})"
    log.info("memory tier: %s; pinning host memory with mlock", reason)
    return "mlock"


def check_budget(name: str, quota: int, floor: int | None, backend: str | None = None) -> None:
    """Check memory tier ``name``'s ``quota`` against the host, at start.

    Raises :class:`~tiering.errors.TierUnavailable` naming the numbers and the fix when the
    quota is over ``RLIMIT_MEMLOCK`` (for ``mlock`` pinning) or over the host's RAM; logs a
    warning when it is over what is available now (less the pressure ``floor``).
    """
    backend = backend or pinning_backend()
    limit = memlock_limit() if backend == "mlock" else None
    if limit is not None and quota > limit:
        raise TierUnavailable(
            f"memory tier {name!r}: quota_bytes {quota} is over this process's locked-memory "
            f"limit (RLIMIT_MEMLOCK, ulimit -l) of {limit} bytes. Raise the limit (docker "
            "compose: ulimits memlock -1, as docker/compose.yaml sets; systemd: "
            "LimitMEMLOCK=infinity; a shell: ulimit -l unlimited) or lower quota_bytes",
            tier=name,
            quota_bytes=quota,
            memlock_bytes=limit,
        )
    info = meminfo()
    total, avail = info.get("MemTotal"), info.get("MemAvailable")
    if total is not None and quota > total:
        raise TierUnavailable(
            f"memory tier {name!r}: quota_bytes {quota} is over this host's memory "
            f"(MemTotal {total} bytes); lower quota_bytes",
            tier=name,
            quota_bytes=quota,
            mem_total_bytes=total,
        )
    if total is not None and avail is not None:
        spare = avail - (default_floor(total) if floor is None else floor)
        if quota > spare:
            log.warning(
                "memory tier %r: quota_bytes %d is over the memory available now (%d bytes "
                "above the pressure floor); it will fill only as far as memory allows",
                name,
                quota,
                max(0, spare),
            )


class HostAllocation:
    """``nbytes`` of page-locked host memory, seen as a flat ``uint8`` array.

    :meth:`free` gives it back (idempotent). A view still held elsewhere keeps the mapping
    alive until it goes, but unlocked (mlock) or no longer counted by tierd.
    """

    def __init__(self, nbytes: int, backend: str) -> None:
        self.nbytes = nbytes
        self.backend = backend
        self._owner: Any = None
        self._locked = False
        if nbytes == 0:
            self.array: np.ndarray | None = np.empty(0, np.uint8)
        elif backend == "cuda":
            self.array = self._cuda(nbytes)
        elif backend == "mlock":
            self.array = self._mlock(nbytes)
        else:
            raise ValueError(f"unknown pinning backend {backend!r}; cuda or mlock")

    @property
    def pinned(self) -> bool:
        return self.nbytes == 0 or self.backend == "cuda" or self._locked

    def _cuda(self, n: int) -> np.ndarray:
        import cupy

        try:
            mem = cupy.cuda.PinnedMemory(n, _HOST_ALLOC_PORTABLE)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise InsufficientSpace(f"cannot pin {n} bytes of host memory: {exc}", size=n) from None
        self._owner = mem
        return np.frombuffer(cupy.cuda.PinnedMemoryPointer(mem, 0), np.uint8, n)

    def _mlock(self, n: int) -> np.ndarray:
        mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        array = np.frombuffer(mm, np.uint8, n)
        if _libc().mlock(ctypes.c_void_p(array.ctypes.data), ctypes.c_size_t(n)) != 0:
            err = ctypes.get_errno()
            del array
            mm.close()
            raise InsufficientSpace(
                f"cannot lock {n} bytes of host memory: {os.strerror(err)} (RLIMIT_MEMLOCK is "
                f"{memlock_limit()} bytes; raise it, e.g. LimitMEMLOCK=infinity)",
                size=n,
            )
        self._owner, self._locked = mm, True
        return array

    def free(self) -> None:
        array, self.array = self.array, None
        owner, self._owner = self._owner, None
        if array is None or owner is None:
            return
        if self._locked:
            _libc().munlock(ctypes.c_void_p(array.ctypes.data), ctypes.c_size_t(self.nbytes))
            self._locked = False
        del array
        if isinstance(owner, mmap.mmap):
            # A view someone still holds keeps the mapping; it unmaps when that view goes.
            with contextlib.suppress(BufferError):
                owner.close()


def allocate(nbytes: int, backend: str | None = None) -> HostAllocation:
    """Page-locked host memory of ``nbytes`` (backend: :func:`pinning_backend` by default).

    Raises :class:`~tiering.errors.InsufficientSpace` when the host refuses to pin it.
    """
    return HostAllocation(nbytes, backend or pinning_backend())


@functools.cache
def _libc() -> Any:
    lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    lib.mlock.argtypes = lib.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.mlock.restype = lib.munlock.restype = ctypes.c_int
    return lib
