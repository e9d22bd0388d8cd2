"""Compressed files decoded on the GPU: the stored bytes cross PCIe, the logical bytes appear
in device memory (issue 29).

A compressed file (:mod:`tiering.codec`) read into GPU memory is not decoded on the host:
for each chunk a load touches, a worker

1. reads the chunk's stored bytes into its pinned host buffer and checks their digest (the
   logical bytes never reach the host, so the stored ones are what is checked; the writer
   published them only after they decoded back to the logical bytes);
2. copies them to device memory as they are (0.69 of a bf16 chunk's bytes);
3. has nvCOMP's batched Zstd decoder decode every frame of the chunk at once, each frame
   where it lies in the stored bytes (the format aligns them for it), into the destination
   (ZSTD) or into a scratch of the high bytes (SPLIT2), then one kernel interleaves the high
   and the low bytes into the destination;
4. waits for its stream.

Workers run at once, each with its own stream, nvCOMP codec (nvCOMP's codecs are
thread-local) and buffers, so one chunk's read overlaps others' copies and decodes. A chunk
only part of which is wanted is decoded into a scratch chunk and the part copied out; a chunk
several ranges touch is decoded once. Nothing here runs unless nvCOMP is installed
(``pip install 'tierd[gpu-codec]'``): without it, compressed files are decoded on the host as
any reader of them does, and :func:`available` says why.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiering.codec import CHUNK, FRAME, Container, Kind
from tiering.codec._format import ALIGN, frame_spans, read_frame_table
from tiering.ranges import settle

from ._device import Device, import_cupy

__all__ = ["GpuDecoder", "available"]

NVCOMP_HINT = (
    "compressed files are decoded on the host instead; install nvCOMP to decode them on the "
    "GPU: pip install 'tierd[gpu-codec]'"
)

#: One thread of a CUDA block interleaves this many element pairs (grid-stride loop).
_BLOCK = 256
_INTERLEAVE = r"""
extern "C" __global__ void interleave(const unsigned char* hi, const unsigned char* lo,
                                      unsigned char* out, long long n, int aligned) {
    long long stride = (long long)blockDim.x * gridDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (aligned) {
        unsigned short* words = (unsigned short*)out;
        for (; i < n; i += stride) words[i] = (unsigned short)((hi[i] << 8) | lo[i]);
    } else {
        for (; i < n; i += stride) { out[2 * i] = lo[i]; out[2 * i + 1] = hi[i]; }
    }
}
"""

_probe_lock = threading.Lock()
_probed: tuple[Any, str | None] | None = None


def _nvcomp() -> tuple[Any, str | None]:
    """nvCOMP's module, or None and why not (asked once a process)."""
    global _probed
    with _probe_lock:
        if _probed is None:
            try:
                nvcomp = importlib.import_module("nvidia.nvcomp")
                nvcomp.set_device_allocator(_pool_alloc)
                _probed = (nvcomp, None)
            except Exception as exc:  # ImportError, or its library failing to load
                _probed = (None, f"nvCOMP is not available ({exc}); {NVCOMP_HINT}")
        return _probed


def _pool_alloc(nbytes: int, stream: Any) -> Any:
    """nvCOMP's scratch from CuPy's pool: its own allocator calls cudaMalloc and cudaFree for
    every batch, and cudaFree waits for the whole device."""
    return import_cupy().cuda.alloc(nbytes)


def available() -> str | None:
    """None where compressed files can be decoded on the GPU, else why not."""
    return _nvcomp()[1]


@dataclass
class _Slot:
    """One worker's stream, codec and buffers (made at its first chunk, kept)."""

    stream: Any
    codec: Any
    host: np.ndarray  # pinned, a chunk's stored bytes
    stored: Any  # device, a chunk's stored bytes
    high: Any  # device, a SPLIT2 chunk's high bytes
    chunk: Any = None  # device, a whole chunk, for chunks only part of which is wanted
    configs: dict[tuple[int, int], Any] = field(default_factory=dict)  # nvCOMP's, by shape
    pinned: Any = field(default=None, repr=False)  # keeps ``host``'s memory


@dataclass(frozen=True)
class _Part:
    """Bytes ``[within, within + n)`` of one chunk, to ``dst_at`` of the destination."""

    within: int
    n: int
    dst_at: int


class GpuDecoder:
    """Decodes compressed files into one device's memory (see the module).

    ``workers`` chunks are in flight at once; each worker holds about three chunks of device
    memory and one of pinned host memory while the decoder lives.
    """

    def __init__(self, device: Device, workers: int = 8) -> None:
        nvcomp, why = _nvcomp()
        if nvcomp is None:
            raise RuntimeError(why)
        self._nvcomp = nvcomp
        self._device = device
        self._workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tierd-gpu-decode")
        self._slots: list[_Slot] = []  # every slot made
        self._free: list[_Slot] = []
        self._lock = threading.Lock()
        self._kernel: Any = None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            slots, self._slots, self._free = self._slots, [], []
        if not slots:
            return
        with self._device.current():
            for slot in slots:
                # Each codec goes before the stream it was made on (it synchronizes that
                # stream when it is destroyed), then the buffers.
                slot.stream.synchronize()
                slot.codec = None
                slot.stream = None

    # -- a call --------------------------------------------------------------------------------
    def read(
        self, container: Container, dst: Any, segments: Sequence[tuple[int, int, int]]
    ) -> None:
        """Every ``(file_offset, nbytes, dst_offset)`` of ``container``'s logical bytes into
        flat uint8 device array ``dst``; each chunk touched is read, checked and decoded once.
        Raises :class:`~tiering.codec.CorruptContainer` for a damaged chunk."""
        by_chunk: dict[int, list[_Part]] = {}
        for off, n, at in segments:
            end = min(off + n, container.size)
            while off < end:
                c, within = divmod(off, container.chunk_size)
                take = min(end - off, container.logical_length(c) - within)
                by_chunk.setdefault(c, []).append(_Part(within, take, at))
                off += take
                at += take
        base = int(dst.data.ptr)
        futures = [
            self._pool.submit(self._chunk, container, c, parts, base)
            for c, parts in sorted(by_chunk.items())
        ]
        settle(futures)

    # -- one chunk, on a worker ----------------------------------------------------------------
    def _take(self) -> _Slot:
        """A free slot (each worker takes one for a chunk and gives it back)."""
        with self._lock:
            if self._free:
                return self._free.pop()
        cp = import_cupy()
        self._device.make_current()
        stream = cp.cuda.Stream(non_blocking=True)
        codec = self._nvcomp.Codec(
            algorithm="Zstd",
            bitstream_kind=self._nvcomp.BitstreamKind.RAW,
            cuda_stream=stream.ptr,
            device_id=self._device.index,
        )
        room = CHUNK + CHUNK // 8  # a stored chunk is never over its logical size + tables
        pinned = cp.cuda.alloc_pinned_memory(room)
        slot = _Slot(
            stream=stream,
            codec=codec,
            host=np.frombuffer(pinned, dtype=np.uint8, count=room),
            stored=cp.empty(room, dtype=cp.uint8),
            high=cp.empty(CHUNK // 2, dtype=cp.uint8),
            pinned=pinned,
        )
        with self._lock:
            self._slots.append(slot)
        return slot

    def _give(self, slot: _Slot) -> None:
        with self._lock:
            self._free.append(slot)

    def _chunk(self, container: Container, c: int, parts: list[_Part], base: int) -> None:
        self._device.make_current()
        slot = self._take()
        try:
            self._decode(container, c, parts, base, slot)
        finally:
            slot.stream.synchronize()  # nothing of this chunk may still run on the slot
            self._give(slot)

    def _decode(
        self, container: Container, c: int, parts: list[_Part], base: int, slot: _Slot
    ) -> None:
        cp = import_cupy()
        e = container.index[c]
        n = container.logical_length(c)
        if e.length > len(slot.host):
            raise container.corrupt(c, "its stored length is over any chunk's")
        host = container.read_stored(c, memoryview(slot.host.data))
        h2d = cp.cuda.runtime.memcpyHostToDevice
        # A chunk wholly wanted is decoded where it goes, if that is aligned as nvCOMP wants
        # its outputs (a safetensors tensor's bytes are; a range at an odd offset is not).
        whole = len(parts) == 1 and parts[0].within == 0 and parts[0].n == n
        whole = whole and (base + parts[0].dst_at) % ALIGN == 0
        if e.kind == Kind.RAW:
            if e.length != n:
                raise container.corrupt(c, "a raw chunk has the wrong length")
            for p in parts:  # straight from the pinned bytes to where they go
                cp.cuda.runtime.memcpyAsync(
                    base + p.dst_at, slot.host.ctypes.data + p.within, p.n, h2d, slot.stream.ptr
                )
            return
        cp.cuda.runtime.memcpyAsync(
            slot.stored.data.ptr, slot.host.ctypes.data, e.length, h2d, slot.stream.ptr
        )
        out_ptr = base + parts[0].dst_at if whole else self._scratch(slot, cp).data.ptr
        if e.kind == Kind.ZSTD:
            self._frames(container, c, host, slot, n, out_ptr)
        else:
            if n % 2:
                raise container.corrupt(c, "a 2-byte chunk has an odd length")
            end = self._frames(container, c, host, slot, n // 2, int(slot.high.data.ptr))
            if e.length - end != n // 2:
                raise container.corrupt(c, "its low bytes have the wrong length")
            self._interleave(cp, slot, int(slot.stored.data.ptr) + end, out_ptr, n // 2)
        if not whole:
            d2d = cp.cuda.runtime.memcpyDeviceToDevice
            for p in parts:
                cp.cuda.runtime.memcpyAsync(
                    base + p.dst_at, out_ptr + p.within, p.n, d2d, slot.stream.ptr
                )

    def _scratch(self, slot: _Slot, cp: Any) -> Any:
        if slot.chunk is None:
            slot.chunk = cp.empty(CHUNK, dtype=cp.uint8)
        return slot.chunk

    def _frames(
        self, container: Container, c: int, host: memoryview, slot: _Slot, n: int, out_ptr: int
    ) -> int:
        """Queue the decode of the chunk's frames (``n`` bytes in all) to ``out_ptr``;
        returns where the frames end in the stored bytes."""
        sizes, start = read_frame_table(host, container.name, c)
        if len(sizes) != -(-n // FRAME):
            raise container.corrupt(c, "its frame table has the wrong count")
        starts, end = frame_spans(sizes, start)
        if end > len(host):
            raise container.corrupt(c, "its frames run past the chunk")
        nv = self._nvcomp
        stream = slot.stream.ptr
        srcs = nv.as_arrays(slot.stored, starts, sizes, cuda_stream=stream)
        outs = nv.as_arrays(
            _at(out_ptr, n),
            [i * FRAME for i in range(len(sizes))],
            [min(FRAME, n - i * FRAME) for i in range(len(sizes))],
            cuda_stream=stream,
        )
        try:
            # nvCOMP reads every frame's header back to the host (a stream sync) unless given
            # a config; one made for chunks of the same shape serves them all.
            key = (len(sizes), n)
            config = slot.configs.get(key)
            if config is None:
                config = slot.configs[key] = slot.codec.decompression_config(srcs)
            slot.codec.decode(srcs, out=outs, decompression_config=config)
        except Exception as exc:  # nvCOMP's error for a frame it cannot decode
            raise container.corrupt(c, f"nvCOMP: {exc}") from exc
        return end

    def _interleave(self, cp: Any, slot: _Slot, lo_ptr: int, out_ptr: int, n: int) -> None:
        if self._kernel is None:
            with self._lock:
                if self._kernel is None:
                    self._kernel = cp.RawKernel(_INTERLEAVE, "interleave")
        blocks = min(-(-n // _BLOCK), 4 * 132 * 8)  # enough to fill any GPU; the loop strides
        aligned = np.int32(out_ptr % 2 == 0)
        args = (slot.high, _at(lo_ptr, n), _at(out_ptr, 2 * n), np.int64(n), aligned)
        with slot.stream:
            self._kernel((blocks,), (_BLOCK,), args)


def _at(ptr: int, n: int) -> Any:
    """``n`` bytes of device memory at ``ptr`` (part of a caller's array) as a CuPy array."""
    cp = import_cupy()
    mem = cp.cuda.UnownedMemory(ptr, n, None)
    return cp.ndarray((n,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
