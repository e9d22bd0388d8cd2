"""Vector gather: rows of a row-major matrix file, in request order.

Two ways to fetch rows, chosen by the shape of the request:

- **runs**: consecutive indices (``i, i+1, ...``) are coalesced into one ``preadv`` each.
  Best when rows come in long runs, and the only sane way on a cold file.
- **scattered**: ``np.take`` from a read-only memory map, split over threads. One KvikIO
  ``pread`` per 4 KiB row reaches 0.25 GB/s on the H100 machine; copying rows out of the page
  cache through a populated mapping costs a memcpy per row and no system call.

Rows land in host memory: the caller's array for ``cpu``, or a reused pinned staging buffer
for a GPU, copied to the device in one ``memcpyAsync`` per batch while the next batch is
being gathered. How a batch's rows are fetched is a *fill* function: :func:`local_fill` (the
two ways above, for a local file) or a remote file's coalesced ranged reads
(:meth:`tiering.io._remote.RemoteReads.row_filler`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np

from ._backends import pread_full
from ._device import Device, import_cupy

__all__ = ["Fill", "PinnedPool", "gather_rows", "local_fill", "plan_runs"]

# A request whose mean run is at least this many rows is read run by run.
_RUNS_MIN_MEAN = 8

Fill = Callable[[np.ndarray, np.ndarray], None]
"""``fill(idx, out)``: rows ``idx`` of a matrix file, in order, into host ``out`` (n x row)."""


def plan_runs(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split ``idx`` into runs of consecutive rows, in request order.

    Returns ``(first_row, length, out_position)`` arrays, one entry per run.
    """
    if idx.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    ends = np.concatenate((breaks, [idx.size])).astype(np.int64)
    return idx[starts].astype(np.int64), ends - starts, starts


class PinnedPool:
    """Reused page-locked host buffers for staging (``cudaHostAlloc`` costs ms per call)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[tuple[int, Any, np.ndarray]] = []

    def acquire(self, nbytes: int) -> tuple[Any, np.ndarray]:
        with self._lock:
            fits = [i for i, (size, _, _) in enumerate(self._free) if size >= nbytes]
            if fits:
                best = min(fits, key=lambda i: self._free[i][0])
                _, mem, view = self._free.pop(best)
                return mem, view
        size = max(2 << 20, -(-nbytes // (2 << 20)) * (2 << 20))
        mem = import_cupy().cuda.alloc_pinned_memory(size)
        return mem, np.frombuffer(mem, dtype=np.uint8, count=size)

    def release(self, mem: Any, view: np.ndarray) -> None:
        with self._lock:
            self._free.append((view.nbytes, mem, view))

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def _split(n: int, parts: int, minimum: int) -> list[tuple[int, int]]:
    parts = max(1, min(parts, n // max(1, minimum)))
    bounds = np.linspace(0, n, parts + 1).astype(np.int64)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def _fill_host(
    fd: int,
    rows: Callable[[], np.ndarray],
    idx: np.ndarray,
    row_bytes: int,
    out: np.ndarray,
    pool: Executor,
    threads: int,
) -> None:
    """Fill ``out`` (n x row_bytes, uint8, host) with rows ``idx`` in order."""
    n = idx.size
    if n == 0:
        return
    first, length, pos = plan_runs(idx)
    jobs: list[Callable[[], None]] = []
    if n // first.size >= _RUNS_MIN_MEAN:
        flat = out.reshape(-1).data

        def read_runs(a: int, b: int) -> None:
            for r in range(a, b):
                o = int(pos[r]) * row_bytes
                k = int(length[r]) * row_bytes
                pread_full(fd, flat[o : o + k], int(first[r]) * row_bytes)

        jobs = [functools.partial(read_runs, a, b) for a, b in _split(first.size, threads, 1)]
    else:
        data = rows()
        matrix = data[: (data.size // row_bytes) * row_bytes].reshape(-1, row_bytes)

        def take(a: int, b: int) -> None:
            np.take(matrix, idx[a:b], axis=0, out=out[a:b])

        jobs = [functools.partial(take, a, b) for a, b in _split(n, threads, 256)]
    if len(jobs) == 1:
        jobs[0]()
        return
    futures: list[Future[None]] = [pool.submit(job) for job in jobs]
    errors = [f.exception() for f in futures]  # wait for all before anyone reuses ``out``
    for err in errors:
        if err is not None:
            raise err


def local_fill(
    fd: int, rows: Callable[[], np.ndarray], row_bytes: int, pool: Executor, threads: int
) -> Fill:
    """The :data:`Fill` of a local file: runs by ``preadv``, scattered rows from its map."""
    return lambda idx, out: _fill_host(fd, rows, idx, row_bytes, out, pool, threads)


def gather_rows(
    *,
    fill: Fill,
    idx: np.ndarray,
    row_bytes: int,
    out: Any,
    device: Device,
    batch_bytes: int,
    pinned: PinnedPool | None,
) -> None:
    """Gather rows ``idx`` of the matrix into flat ``uint8`` ``out`` on ``device``."""
    n = idx.size
    if not device.is_cuda:
        fill(idx, out.reshape(n, row_bytes))
        return
    assert pinned is not None
    cp = import_cupy()
    per_batch = max(1, batch_bytes // row_bytes)
    stream = cp.cuda.Stream(non_blocking=True)
    staged = [
        pinned.acquire(min(n, per_batch) * row_bytes) for _ in range(2 if n > per_batch else 1)
    ]
    events: list[Any] = [None] * len(staged)
    base = int(out.data.ptr)
    try:
        for k, a in enumerate(range(0, n, per_batch)):
            b = min(n, a + per_batch)
            slot = k % len(staged)
            if events[slot] is not None:
                events[slot].synchronize()  # the previous copy out of this buffer is done
            view = staged[slot][1][: (b - a) * row_bytes].reshape(b - a, row_bytes)
            fill(idx[a:b], view)
            cp.cuda.runtime.memcpyAsync(
                base + a * row_bytes,
                view.ctypes.data,
                (b - a) * row_bytes,
                cp.cuda.runtime.memcpyHostToDevice,
                stream.ptr,
            )
            ev = cp.cuda.Event(block=False, disable_timing=True)
            ev.record(stream)
            events[slot] = ev
        stream.synchronize()
    finally:
        stream.synchronize()
        for mem, view in staged:
            pinned.release(mem, view)
