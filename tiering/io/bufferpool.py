"""Released buffers kept for the next lease of the same size (see :class:`BufferPool`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ._device import Device
from .buffers import DeviceBuffer, alloc_size, allocate

__all__ = ["BufferPool"]


class BufferPool:
    """Idle GPU allocations kept for reuse by the next lease of the same size.

    ``cudaMalloc``, ``cudaFree`` (which synchronises the device) and the IPC handle cost far
    more than a 4 KiB read, and a fresh shared-memory segment's pages cost a fault each on
    first touch. A released buffer therefore waits here for the next allocation of its size:
    at most ``max_idle_bytes`` per device (None: no cap of its own, the owner keeps leased
    plus idle within its budget with :meth:`trim`), for at most ``idle_s`` seconds. A waiting
    shared-memory segment is renamed (:func:`idle_prefix`) and gets a fresh name for its next
    lease: a released lease's name stops opening. Its bytes are the last lease's until the
    next load overwrites them: a client must not use a buffer after releasing it.

    A GPU is shared with other processes, so an allocation may fail for want of device memory
    inside the budget: the idle buffers are freed then, and ``on_short(device, nbytes)`` (the
    residency's kept copies) asked for the room, before one more try.
    """

    def __init__(self, max_idle_bytes: int | None = 2 << 30, idle_s: float = 30.0) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._idle: dict[tuple[Device, int], list[tuple[float, DeviceBuffer]]] = {}
        self._bytes: dict[Device, int] = {}
        self.on_short: Callable[[Device, int], int] | None = None

    def get(self, device: Device, nbytes: int) -> DeviceBuffer:
        """An idle allocation of the right size, else a new one (see :func:`allocate`)."""
        size = alloc_size(device, nbytes)
        while True:
            with self._lock:
                stack = self._idle.get((device, size))
                if not stack:
                    break
                _t, buf = stack.pop()
                self._bytes[device] -= size
            if buf.unpark():
                return buf
            buf.free()  # renamed away behind tierd's back: a new one instead
        try:
            return allocate(device, nbytes)
        except Exception as exc:
            if not (device.is_cuda and _out_of_memory(exc)):
                raise
            self.clear_device(device)
            if self.on_short is not None and self.on_short(device, size) > 0:
                self.clear_device(device)  # what it let go came back here, idle
            return allocate(device, nbytes)

    def put(self, buf: DeviceBuffer) -> None:
        """Take a buffer back: kept idle if there is room, else freed."""
        with self._lock:
            held = self._bytes.get(buf.device, 0)
            cap = self.max_idle_bytes
            keep = cap is None or held + buf.alloc_bytes <= cap
            if keep:  # counted now, so two puts at once cannot both pass the cap
                self._bytes[buf.device] = held + buf.alloc_bytes
        if keep and buf.park():
            with self._lock:
                key = (buf.device, buf.alloc_bytes)
                self._idle.setdefault(key, []).append((time.monotonic(), buf))
            return
        if keep:
            with self._lock:
                self._bytes[buf.device] -= buf.alloc_bytes
        buf.free()

    def trim(self, device: Device, keep: int) -> None:
        """Free the oldest idle buffers of ``device`` until at most ``keep`` bytes are idle."""
        self._drop(lambda d, t: d == device, device_keep=(device, max(0, keep)))

    def expire(self) -> None:
        """Free buffers idle for longer than ``idle_s``."""
        cutoff = time.monotonic() - self.idle_s
        self._drop(lambda d, t: t < cutoff)

    def clear(self) -> None:
        self._drop(lambda d, t: True)

    def clear_device(self, device: Device) -> None:
        self._drop(lambda d, t: d == device)

    def idle_bytes(self) -> dict[str, int]:
        with self._lock:
            return {str(d): n for d, n in self._bytes.items()}

    def _drop(
        self,
        match: Callable[[Device, float], bool],
        device_keep: tuple[Device, int] | None = None,
    ) -> None:
        gone: list[DeviceBuffer] = []
        with self._lock:
            entries = sorted(
                ((t, key, buf) for key, stack in self._idle.items() for t, buf in stack),
                key=lambda e: e[0],
            )
            for t, key, buf in entries:
                dev = key[0]
                if not match(dev, t):
                    continue
                if device_keep is not None and self._bytes.get(dev, 0) <= device_keep[1]:
                    break
                self._idle[key] = [(tt, b) for tt, b in self._idle[key] if b is not buf]
                self._bytes[dev] -= buf.alloc_bytes
                gone.append(buf)
        for buf in gone:
            buf.free()


def _out_of_memory(exc: Exception) -> bool:
    # CuPy's cudaMalloc failing: CUDARuntimeError(cudaErrorMemoryAllocation), or the
    # OutOfMemoryError of its allocator.
    return type(exc).__name__ == "OutOfMemoryError" or "cudaErrorMemoryAllocation" in str(exc)
