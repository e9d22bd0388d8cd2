"""Reads of bytes that are already in memory: a memory tier's pinned host copy, or a copy
resident on a GPU.

A :class:`CopyFile` looks like any other open file to the loaders (size, ranged reads, a
header read for safetensors), but its bytes are an array held by someone else (the memory
tier, or the GPU residency of the service). A read of it is no I/O at all: one
``cudaMemcpyAsync`` (pinned host → device is pure DMA at the link's rate; device → device runs
at the GPU's memory bandwidth), one ``cudaMemcpyPeerAsync`` between two GPUs, or one
``memcpy`` on the host. Every read is counted under the ``copy`` I/O path, the tier that holds
the file's authoritative bytes, and the copy's :data:`~tiering.io.LoadSource`.

The holder keeps the array alive and unchanged while the file is open: ``on_close`` tells it
when the last read has ended (for a copy queued under a :class:`~tiering.io.fences.Fence`,
when it has landed, which may be after the file was closed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tiering.errors import InvalidInput

from ._device import Device, import_cupy
from ._file import GdsFile
from ._stats import IoReport, LoadSource, Stats

if TYPE_CHECKING:
    from .fences import Fence

__all__ = ["CopyFile", "copy_into", "peer_access"]

# cudaMemcpyKind values (cuda_runtime_api.h): what CuPy's runtime module takes.
_H2D, _D2H, _D2D = 1, 2, 3


class CopyFile(GdsFile):
    """A file whose bytes are held in memory: a flat ``uint8`` array on the host (``held_on``
    ``cpu``, pinned where the host has CUDA) or on a GPU (``held_on`` ``cuda:N``), after
    ``head``, the file's first bytes in host memory (empty where ``array`` is the whole file).

    A head is how a copy of a safetensors shard's tensors alone serves every read of the file:
    the header comes from the head, the tensors from the device.

    Made by :meth:`GpuDirectStorage.open_copy <tiering.io.GpuDirectStorage.open_copy>`.
    """

    def __init__(
        self,
        array: Any,
        held_on: Device,
        *,
        name: str,
        tier: str | None,
        rank: int | None,
        alignment: int,
        owner: object,
        target: Device,
        on_close: Callable[[], None] | None = None,
        head: bytes = b"",
    ) -> None:
        super().__init__(
            Path(name),
            -1,
            len(head) + int(array.nbytes),
            tier=tier,
            rank=rank,
            alignment=alignment,
            handle=None,
            io_path="copy",
            owner=owner,
        )
        self.array = array
        self.held_on = held_on
        #: The file's bytes before ``array``'s: where ``array``'s first byte lies in the file.
        self.head = np.frombuffer(head, dtype=np.uint8)
        self.base = len(head)
        self.source: LoadSource = _source(held_on, target)
        self._on_close = on_close
        self._queued = 0  # copies out of the array queued under a fence, not yet landed
        self._released = False

    def _rows(self, populate: bool) -> np.ndarray:
        if self.held_on.is_cuda or self.base:
            raise InvalidInput(f"{self.path} is held on {self.held_on}: it has no host rows")
        view: np.ndarray = self.array.view()
        view.flags.writeable = False  # gathers read it; nothing may write the holder's copy
        return view

    def _release(self) -> None:
        self.array = None
        with self._cond:
            self._released = True
            if self._queued:
                return  # the last queued copy's landing tells the holder
        self._tell_holder()

    def _hold_until(self, fence: Fence) -> None:
        """A copy out of the array was queued under ``fence``: the holder must keep the
        array, unchanged, until it lands, even if the file is closed sooner."""
        with self._cond:
            self._queued += 1
        fence.then(self._landed)

    def _landed(self, _fence: Fence) -> None:
        with self._cond:
            self._queued -= 1
            if self._queued or not self._released:
                return
        self._tell_holder()

    def _tell_holder(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def read_bytes(self, n: int, offset: int) -> bytes:
        end = min(offset + max(0, n), self.base + int(self.array.nbytes))
        out = bytes(self.head[offset:end])
        if end > self.base:
            part = self.array[max(offset, self.base) - self.base : end - self.base]
            out += bytes(import_cupy().asnumpy(part) if self.held_on.is_cuda else part)
        return out


def _source(held_on: Device, target: Device) -> LoadSource:
    if not held_on.is_cuda:
        return "memory"
    if target.is_cuda and target.index != held_on.index:
        return "peer"
    return "gpu"


_peers: set[tuple[int, int]] = set()
_peers_lock = threading.Lock()


def peer_access(dst: int, src: int) -> bool:
    """Whether GPU ``dst`` can read GPU ``src``'s memory directly (NVLink or PCIe P2P); turns
    that access on the first time (once per process and pair)."""
    if dst == src:
        return True
    with _peers_lock:
        if (dst, src) in _peers:
            return True
        cp = import_cupy()
        if not cp.cuda.runtime.deviceCanAccessPeer(dst, src):
            return False
        with cp.cuda.Device(dst):
            try:
                cp.cuda.runtime.deviceEnablePeerAccess(src)
            except cp.cuda.runtime.CUDARuntimeError as exc:
                # Enabled already (by CuPy or another library in this process): fine.
                if "PeerAccessAlreadyEnabled" not in str(exc):
                    raise
        _peers.add((dst, src))
        return True


_streams: dict[int, Any] = {}
_streams_lock = threading.Lock()


def _stream(index: int) -> Any:
    """One non-blocking stream per device for copies: they neither wait for nor hold up the
    legacy default stream that other work of the process may use."""
    with _streams_lock:
        found = _streams.get(index)
        if found is None:
            cp = import_cupy()
            with cp.cuda.Device(index):
                found = _streams[index] = cp.cuda.Stream(non_blocking=True)
        return found


def copy_into(
    file: CopyFile,
    target: Device,
    dst: Any,
    dst_offset: int,
    file_offset: int,
    nbytes: int,
    stats: Stats,
    fence: Fence | None = None,
) -> IoReport:
    """Copy ``nbytes`` of ``file`` from ``file_offset`` into flat uint8 ``dst[dst_offset:]`` on
    ``target``; counted as one operation under the ``copy`` path. Returns when the bytes have
    landed, or, given a ``fence`` and a GPU target, once the copy is queued: the fence then
    waits for it and ends its count (the report's ``seconds`` are the queueing's alone)."""
    started = stats.begin("copy", file.tier_key, file.source)
    ok = False
    queued = False
    try:
        if nbytes:
            with file.guard():  # (held until the copy is the fence's: no close in between)
                head = max(0, min(nbytes, file.base - file_offset))
                if head:  # a few KiB of header: a plain copy, landed on return
                    _copy_head(file, target, dst, dst_offset, file_offset, head)
                stream = None
                if nbytes > head:
                    at, rest = file_offset + head, nbytes - head
                    stream = _copy(file, target, dst, dst_offset + head, at, rest, fence)
                if stream is not None:
                    assert fence is not None
                    tier, source = file.tier_key, file.source

                    def finish(landed: bool) -> None:
                        stats.end("copy", tier, started, nbytes, landed, source)

                    fence.queued(stream, finish)
                    file._hold_until(fence)
                    queued = True
        ok = True
    finally:
        if queued:
            seconds = time.perf_counter() - started
        else:
            seconds = stats.end("copy", file.tier_key, started, nbytes, ok, file.source)
    return IoReport(nbytes, "copy", file.tier_key, seconds, source=file.source, landed=not queued)


def _copy_head(
    file: CopyFile, target: Device, dst: Any, dst_offset: int, file_offset: int, nbytes: int
) -> None:
    """Bytes of the file's head (host memory) into ``dst``; landed on return."""
    src = file.head[file_offset : file_offset + nbytes]
    if not target.is_cuda:
        np.copyto(dst[dst_offset : dst_offset + nbytes], src)
        return
    cp = import_cupy()
    with cp.cuda.Device(target.index):
        s = _stream(target.index)
        cp.cuda.runtime.memcpyAsync(dst.data.ptr + dst_offset, src.ctypes.data, nbytes, _H2D, s.ptr)
        s.synchronize()


def _copy(
    file: CopyFile,
    target: Device,
    dst: Any,
    dst_offset: int,
    file_offset: int,
    nbytes: int,
    fence: Fence | None,
) -> Any:
    """The copy; the stream it is queued on where ``fence`` waits for it, else None once it
    has landed."""
    src = file.array
    held = file.held_on
    file_offset -= file.base  # where the bytes lie in the array
    if not target.is_cuda:
        out = dst[dst_offset : dst_offset + nbytes]
        if held.is_cuda:
            cp = import_cupy()
            with cp.cuda.Device(held.index):
                s = _stream(held.index)
                cp.cuda.runtime.memcpyAsync(
                    out.ctypes.data, src.data.ptr + file_offset, nbytes, _D2H, s.ptr
                )
                s.synchronize()
        else:
            np.copyto(out, src[file_offset : file_offset + nbytes])
        return None
    cp = import_cupy()
    dst_ptr = dst.data.ptr + dst_offset
    with cp.cuda.Device(target.index):
        s = _stream(target.index)
        if not held.is_cuda:
            cp.cuda.runtime.memcpyAsync(dst_ptr, src.ctypes.data + file_offset, nbytes, _H2D, s.ptr)
        elif held.index == target.index:
            cp.cuda.runtime.memcpyAsync(dst_ptr, src.data.ptr + file_offset, nbytes, _D2D, s.ptr)
        else:
            # Direct over NVLink/PCIe where peer access is on; CUDA stages through the host
            # where it is not (the loaders only offer peer copies that peer_access allows).
            peer_access(target.index, held.index)
            cp.cuda.runtime.memcpyPeerAsync(
                dst_ptr, target.index, src.data.ptr + file_offset, held.index, nbytes, s.ptr
            )
        if fence is not None:
            return s
        s.synchronize()
        return None
