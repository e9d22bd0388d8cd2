"""Compressed files decoded on the GPU: the stored bytes cross PCIe, the logical bytes appear
in device memory (issue 29).

A compressed file (:mod:`tiering.codec`) read into GPU memory is not decoded on the host.
The chunks a load touches go in batches of :data:`BATCH` through one of three lanes, each a
pinned host buffer, device buffers and a stream:

1. host threads read each chunk's stored bytes into the lane's pinned buffer and check their
   digest (the logical bytes never reach the host, so the stored ones are what is checked;
   the writer published them only after they decoded back to the logical bytes);
2. each chunk's stored bytes are copied to device memory as they are (0.69 of a bf16
   chunk's bytes);
3. one call of nvCOMP's batched Zstd decoder decodes every frame of the batch at once (a few
   hundred to a thousand: the GPU decodes a frame per thread block, so a batch must be large
   to fill it), each frame where it lies in the stored bytes (the format aligns them);
4. per chunk, one kernel interleaves the high and the low bytes of a SPLIT2 chunk into the
   destination, or a ZSTD chunk is copied there.

While one lane's batch is on the GPU the host reads the next two into the others. A chunk
only part of which is wanted goes through a scratch chunk; a chunk several ranges touch is
decoded once. One load decodes at a time on a device (it keeps the GPU busy alone).

Nothing here runs unless nvCOMP is installed (``pip install 'tierd[gpu-codec]'``): without it,
compressed files are decoded on the host as any reader of them does, and :func:`available`
says why.

Kept whole past 450 lines: the three lanes of one pipeline (read and check, copy, decode and
interleave) share their buffers and streams.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiering.codec import CHUNK, FRAME, Container, Kind, frame_spans, read_frame_table
from tiering.ranges import settle

from ._device import Device, import_cupy
from ._nvcomp import Zstd, load

__all__ = ["GpuDecoder", "available"]

NVCOMP_HINT = (
    "compressed files are decoded on the host instead; install nvCOMP to decode them on the "
    "GPU: pip install 'tierd[gpu-codec]'"
)
#: Frames of one call at most: a batch of ZSTD chunks (SPLIT2 chunks have half as many).

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

// Every whole SPLIT2 chunk of a batch in one launch: chunk blockIdx.y, its pointers and
// element count from the arrays (one launch a batch, not one a chunk: a launch costs the
// host tens of microseconds, and the host is what a batch waits on).
extern "C" __global__ void interleave_many(const unsigned long long* his,
                                           const unsigned long long* los,
                                           const unsigned long long* outs,
                                           const unsigned long long* ns) {
    const unsigned char* hi = (const unsigned char*)his[blockIdx.y];
    const unsigned char* lo = (const unsigned char*)los[blockIdx.y];
    unsigned char* out = (unsigned char*)outs[blockIdx.y];
    long long n = (long long)ns[blockIdx.y];
    long long stride = (long long)blockDim.x * gridDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (((unsigned long long)out & 1) == 0) {
        unsigned short* words = (unsigned short*)out;
        for (; i < n; i += stride) words[i] = (unsigned short)((hi[i] << 8) | lo[i]);
    } else {
        for (; i < n; i += stride) { out[2 * i] = lo[i]; out[2 * i + 1] = hi[i]; }
    }
}
"""
#: Blocks a chunk gets in the batched launch (grid-stride over its 4 Mi element pairs).
_CHUNK_BLOCKS = 64


def available() -> str | None:
    """None where compressed files can be decoded on the GPU, else why not."""
    why = load()[1]
    return None if why is None else f"{why}; {NVCOMP_HINT}"


#: Chunks decoded by one nvCOMP call (8 MiB each: 64 to 128 frames of 64 KiB a chunk).
#: Measured on an H100 (1 GiB of bf16, page cache): 8 chunks a call decode at 13 GB/s of
#: model bytes, 32 at 30, 64 at 37; 16 host threads read and check stored bytes at ~36.
#: A batch's chunks are read by as many threads, all at once: from a bucket each read is
#: GETs (a compressed object's chunk is about three), and a batch in flight keeps the tier's
#: connections busy as a raw read of the same object would.
BATCH = 32
#: Lanes: one batch decoding while the next two are read.
_LANES = 3
#: Pinned and device bytes a stored chunk may take: its logical size and its frame table,
#: padding included (a chunk that would be larger is stored RAW, at its logical size).
_ROOM = CHUNK + CHUNK // 8
_MAX_FRAMES = BATCH * (CHUNK // FRAME)


@dataclass
class _Lane:
    """A batch's pinned host buffer, device buffers and stream (made at first use, kept)."""

    stream: Any
    host: np.ndarray  # pinned: BATCH stored chunks, at multiples of _ROOM
    stored: Any  # device: the same
    out: Any  # device: BATCH decoded frame sets (a SPLIT2 chunk's high bytes), per CHUNK
    chunk: Any  # device: a whole chunk, for chunks only part of which is wanted
    temp: Any  # device: nvCOMP's scratch
    meta: np.ndarray  # pinned uint64 [4, _MAX_FRAMES]: source and output pointers and sizes
    meta_dev: Any  # device: the same
    results: np.ndarray  # pinned uint64 [2, _MAX_FRAMES]: statuses (int32), decoded sizes
    results_dev: Any  # device: the same
    whole: np.ndarray  # pinned uint64 [4, BATCH]: each whole SPLIT2 chunk's hi, lo, out, n
    whole_dev: Any  # device: the same
    pinned: list[Any] = field(default_factory=list, repr=False)  # keeps the pinned memory
    #: The last batch queued, checked once the lane's stream is synchronized: the container,
    #: each frame's chunk, each frame's expected size.
    pending: tuple[Container, np.ndarray, np.ndarray] | None = None


@dataclass(frozen=True)
class _Part:
    """Bytes ``[within, within + n)`` of one chunk, to ``dst_at`` of the destination."""

    within: int
    n: int
    dst_at: int


@dataclass
class _Job:
    """One chunk of a batch: what is wanted of it, and (once read) where its frames are."""

    c: int
    parts: list[_Part]
    kind: Kind = Kind.RAW
    length: int = 0  # stored bytes
    starts: list[int] = field(default_factory=list)  # frames, within the stored chunk
    sizes: list[int] = field(default_factory=list)
    end: int = 0  # where the frames end (a SPLIT2 chunk's low bytes start)


class GpuDecoder:
    """Decodes compressed files into one device's memory (see the module).

    It holds three lanes: each ``BATCH`` x 9 MiB of pinned host memory (288 MiB) and
    ``BATCH`` x 17 MiB of device memory, made at the first load and kept until closed.
    """

    def __init__(self, device: Device, readers: int = 2 * BATCH) -> None:
        zstd, why = load()
        if zstd is None:
            raise RuntimeError(why)
        self._zstd: Zstd = zstd
        self._device = device
        self._pool = ThreadPoolExecutor(readers, thread_name_prefix="tierd-gpu-decode")
        self._lanes: list[_Lane] = []
        self._lock = threading.Lock()  # one load at a time; guards the lanes
        self._kernels: Any = None  # the interleave kernels (CuPy RawModule), at first use

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            lanes, self._lanes = self._lanes, []
            if not lanes:
                return
            with self._device.current():
                for lane in lanes:
                    lane.stream.synchronize()  # nothing may still use the buffers

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
        jobs = [_Job(c, parts) for c, parts in sorted(by_chunk.items())]
        batches = [jobs[i : i + BATCH] for i in range(0, len(jobs), BATCH)]
        base = int(dst.data.ptr)
        with self._lock:
            self._device.make_current()
            lanes = self._ready_lanes()
            # Batches k+1 and k+2 are read while batch k decodes: a batch waits for its
            # slowest read, and with two batches in flight the reads of one fill the wait of
            # the other (from a bucket a read is a GET held to its connection's rate).
            reading: list[list[Any]] = []
            try:
                for k in range(min(_LANES - 1, len(batches))):
                    reading.append(self._start_reads(container, batches[k], lanes[k]))
                for k, batch in enumerate(batches):
                    settle(reading.pop(0))
                    ahead = k + _LANES - 1
                    if ahead < len(batches):
                        other = lanes[ahead % _LANES]
                        self._settle(other)  # its last batch is done with its buffers
                        reading.append(self._start_reads(container, batches[ahead], other))
                    self._decode(container, batch, lanes[k % _LANES], base)
                for lane in lanes:
                    self._settle(lane)
            finally:
                pending = [f for futures in reading for f in futures]
                for f in pending:  # none may still write into a lane once this call ends
                    f.cancel()
                wait(pending)
                for lane in lanes:
                    lane.stream.synchronize()
                    lane.pending = None

    def _settle(self, lane: _Lane) -> None:
        """Wait for the lane's last batch, and check nvCOMP's status and size of each of its
        frames (a frame it could not decode is an error naming the chunk, never bytes)."""
        lane.stream.synchronize()
        if lane.pending is None:
            return
        container, chunks, want = lane.pending
        lane.pending = None
        n = len(want)
        statuses = lane.results[0].view(np.int32)[:n]  # nvcompStatus_t: 4 bytes each
        bad = np.flatnonzero((statuses != 0) | (lane.results[1, :n] != want))
        if bad.size:
            i = int(bad[0])
            raise container.corrupt(
                int(chunks[i]),
                f"nvCOMP could not decode frame {i} of its batch (status {int(statuses[i])}, "
                f"{int(lane.results[1, i])} of {int(want[i])} bytes)",
            )

    # -- host side: reads ----------------------------------------------------------------------
    def _start_reads(self, container: Container, batch: list[_Job], lane: _Lane) -> list[Any]:
        return [
            self._pool.submit(self._read, container, job, lane, j) for j, job in enumerate(batch)
        ]

    def _read(self, container: Container, job: _Job, lane: _Lane, j: int) -> None:
        """Chunk ``job.c``'s stored bytes into slot ``j`` of the lane, checked, its frames
        found."""
        e = container.index[job.c]
        if e.length > _ROOM:
            raise container.corrupt(job.c, "its stored length is over any chunk's")
        host = container.read_stored(job.c, memoryview(lane.host.data)[j * _ROOM : (j + 1) * _ROOM])
        job.kind, job.length = e.kind, e.length
        n = container.logical_length(job.c)
        if e.kind == Kind.RAW:
            if e.length != n:
                raise container.corrupt(job.c, "a raw chunk has the wrong length")
            return
        if e.kind == Kind.SPLIT2 and n % 2:
            raise container.corrupt(job.c, "a 2-byte chunk has an odd length")
        coded = n if e.kind == Kind.ZSTD else n // 2
        sizes, start = read_frame_table(host, container.name, job.c)
        if len(sizes) != -(-coded // FRAME):
            raise container.corrupt(job.c, "its frame table has the wrong count")
        job.starts, job.end = frame_spans(sizes, start)
        job.sizes = sizes
        if job.end > e.length or (e.kind == Kind.SPLIT2 and e.length - job.end != n // 2):
            raise container.corrupt(job.c, "its frames or low bytes have the wrong length")

    # -- device side: one batch ----------------------------------------------------------------
    def _decode(self, container: Container, batch: list[_Job], lane: _Lane, base: int) -> None:
        cp = import_cupy()
        rt = cp.cuda.runtime
        stream = lane.stream.ptr
        host0, stored0 = lane.host.ctypes.data, int(lane.stored.data.ptr)
        src_offsets: list[int] = []
        src_sizes: list[int] = []
        out_offsets: list[int] = []
        out_sizes: list[int] = []
        chunks: list[int] = []
        for j, job in enumerate(batch):
            at = j * _ROOM
            n = container.logical_length(job.c)
            if job.kind == Kind.RAW:  # straight from the pinned bytes to where they go
                for p in job.parts:
                    rt.memcpyAsync(
                        base + p.dst_at, host0 + at + p.within, p.n, rt.memcpyHostToDevice, stream
                    )
                continue
            rt.memcpyAsync(stored0 + at, host0 + at, job.length, rt.memcpyHostToDevice, stream)
            coded = n if job.kind == Kind.ZSTD else n // 2
            src_offsets += [at + s for s in job.starts]
            src_sizes += job.sizes
            out_offsets += [j * CHUNK + i * FRAME for i in range(len(job.sizes))]
            out_sizes += [min(FRAME, coded - i * FRAME) for i in range(len(job.sizes))]
            chunks += [job.c] * len(job.sizes)
        if src_offsets:
            self._frames(container, lane, src_offsets, src_sizes, out_offsets, out_sizes, chunks)
        whole = []
        for j, job in enumerate(batch):
            if job.kind == Kind.SPLIT2 and self._whole(container, job):
                whole.append((j, job))
            elif job.kind != Kind.RAW:
                self._place(cp, container, job, lane, j, base)
        if whole:
            self._interleave_whole(cp, container, whole, lane, base)

    def _frames(
        self,
        container: Container,
        lane: _Lane,
        src_offsets: list[int],
        src_sizes: list[int],
        out_offsets: list[int],
        out_sizes: list[int],
        chunks: list[int],
    ) -> None:
        """Queue one nvCOMP decode of every frame of the batch into the lane's ``out``, and
        the copy back of its statuses and sizes (checked by :meth:`_settle`)."""
        cp = import_cupy()
        rt = cp.cuda.runtime
        n = len(src_offsets)
        meta = lane.meta[:, :n]
        meta[0] = np.asarray(src_offsets, dtype=np.uint64) + np.uint64(lane.stored.data.ptr)
        meta[1] = src_sizes
        meta[2] = out_sizes
        meta[3] = np.asarray(out_offsets, dtype=np.uint64) + np.uint64(lane.out.data.ptr)
        stream = lane.stream.ptr
        row = _MAX_FRAMES * 8  # bytes of one row of meta
        host, dev = lane.meta.ctypes.data, int(lane.meta_dev.data.ptr)
        for r in range(4):
            rt.memcpyAsync(dev + r * row, host + r * row, n * 8, rt.memcpyHostToDevice, stream)
        res = int(lane.results_dev.data.ptr)
        rt.memsetAsync(res, 0xFF, n * 4, stream)  # a status nvCOMP never wrote is an error
        self._zstd.decompress_async(
            src_ptrs=dev,
            src_bytes=dev + row,
            dst_bytes=dev + 2 * row,
            actual_bytes=res + row,
            frames=n,
            temp=int(lane.temp.data.ptr),
            temp_bytes=int(lane.temp.nbytes),
            dst_ptrs=dev + 3 * row,
            statuses=res,
            stream=stream,
        )
        back = lane.results.ctypes.data
        rt.memcpyAsync(back, res, n * 4, rt.memcpyDeviceToHost, stream)
        rt.memcpyAsync(back + row, res + row, n * 8, rt.memcpyDeviceToHost, stream)
        lane.pending = (container, np.asarray(chunks), np.asarray(out_sizes, dtype=np.uint64))

    @staticmethod
    def _whole(container: Container, job: _Job) -> bool:
        """The whole chunk is wanted, in one piece of the destination."""
        n = container.logical_length(job.c)
        return len(job.parts) == 1 and job.parts[0].within == 0 and job.parts[0].n == n

    def _interleave_whole(
        self, cp: Any, container: Container, whole: list[tuple[int, _Job]], lane: _Lane, base: int
    ) -> None:
        """Interleave every whole SPLIT2 chunk of the batch into the destination, one launch."""
        if self._kernels is None:
            self._kernels = cp.RawModule(code=_INTERLEAVE)
        k = len(whole)
        meta = lane.whole[:, :k]
        stored0, out0 = int(lane.stored.data.ptr), int(lane.out.data.ptr)
        meta[0] = [out0 + j * CHUNK for j, _ in whole]  # the decoded high bytes
        meta[1] = [stored0 + j * _ROOM + job.end for j, job in whole]  # the raw low bytes
        meta[2] = [base + job.parts[0].dst_at for _, job in whole]
        meta[3] = [container.logical_length(job.c) // 2 for _, job in whole]
        rt = cp.cuda.runtime
        row = BATCH * 8
        host, dev = lane.whole.ctypes.data, int(lane.whole_dev.data.ptr)
        for r in range(4):
            rt.memcpyAsync(
                dev + r * row, host + r * row, k * 8, rt.memcpyHostToDevice, lane.stream.ptr
            )
        kernel = self._kernels.get_function("interleave_many")
        with lane.stream:
            kernel((_CHUNK_BLOCKS, k), (_BLOCK,), tuple(lane.whole_dev[r] for r in range(4)))

    def _place(
        self, cp: Any, container: Container, job: _Job, lane: _Lane, j: int, base: int
    ) -> None:
        """Queue the chunk's decoded bytes into the destination (through the scratch chunk
        when only part of it is wanted)."""
        rt = cp.cuda.runtime
        stream = lane.stream.ptr
        n = container.logical_length(job.c)
        whole = len(job.parts) == 1 and job.parts[0].within == 0 and job.parts[0].n == n
        target = base + job.parts[0].dst_at if whole else int(lane.chunk.data.ptr)
        decoded = int(lane.out.data.ptr) + j * CHUNK
        if job.kind == Kind.ZSTD:
            if whole:
                rt.memcpyAsync(target, decoded, n, rt.memcpyDeviceToDevice, stream)
                return
            target = decoded  # the parts are copied straight from the decoded chunk
        else:
            low = int(lane.stored.data.ptr) + j * _ROOM + job.end
            self._interleave(cp, lane, decoded, low, target, n // 2)
            if whole:
                return
        for p in job.parts:
            rt.memcpyAsync(base + p.dst_at, target + p.within, p.n, rt.memcpyDeviceToDevice, stream)

    def _interleave(
        self, cp: Any, lane: _Lane, hi_ptr: int, lo_ptr: int, out_ptr: int, n: int
    ) -> None:
        if self._kernels is None:
            self._kernels = cp.RawModule(code=_INTERLEAVE)
        blocks = min(-(-n // _BLOCK), 4 * 132 * 8)  # enough to fill any GPU; the loop strides
        aligned = np.int32(out_ptr % 2 == 0)
        args = (_at(hi_ptr, n), _at(lo_ptr, n), _at(out_ptr, 2 * n), np.int64(n), aligned)
        with lane.stream:
            self._kernels.get_function("interleave")((blocks,), (_BLOCK,), args)

    def _ready_lanes(self) -> list[_Lane]:
        """The lanes (made at the first load)."""
        if not self._lanes:
            cp = import_cupy()
            temp = self._zstd.temp_bytes(_MAX_FRAMES, FRAME, BATCH * CHUNK)
            for _ in range(_LANES):
                pinned = [
                    cp.cuda.alloc_pinned_memory(BATCH * _ROOM),
                    cp.cuda.alloc_pinned_memory(4 * _MAX_FRAMES * 8),
                    cp.cuda.alloc_pinned_memory(2 * _MAX_FRAMES * 8),
                    cp.cuda.alloc_pinned_memory(4 * BATCH * 8),
                ]
                host, meta, results, whole = (
                    np.frombuffer(m, dtype=dt, count=k).reshape(shape)
                    for m, dt, k, shape in (
                        (pinned[0], np.uint8, BATCH * _ROOM, (-1,)),
                        (pinned[1], np.uint64, 4 * _MAX_FRAMES, (4, _MAX_FRAMES)),
                        (pinned[2], np.uint64, 2 * _MAX_FRAMES, (2, _MAX_FRAMES)),
                        (pinned[3], np.uint64, 4 * BATCH, (4, BATCH)),
                    )
                )
                self._lanes.append(
                    _Lane(
                        stream=cp.cuda.Stream(non_blocking=True),
                        host=host,
                        stored=cp.empty(BATCH * _ROOM, dtype=cp.uint8),
                        out=cp.empty(BATCH * CHUNK, dtype=cp.uint8),
                        chunk=cp.empty(CHUNK, dtype=cp.uint8),
                        temp=cp.empty(max(temp, 1), dtype=cp.uint8),
                        meta=meta,
                        meta_dev=cp.empty((4, _MAX_FRAMES), dtype=cp.uint64),
                        results=results,
                        results_dev=cp.empty((2, _MAX_FRAMES), dtype=cp.uint64),
                        whole=whole,
                        whole_dev=cp.empty((4, BATCH), dtype=cp.uint64),
                        pinned=pinned,
                    )
                )
        return self._lanes


def _at(ptr: int, n: int) -> Any:
    """``n`` bytes of device memory at ``ptr`` (part of a caller's array) as a CuPy array."""
    cp = import_cupy()
    mem = cp.cuda.UnownedMemory(ptr, n, None)
    return cp.ndarray((n,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
