"""Remote reads over tierd's own HTTP connections (:class:`~tiering.ranges.HttpRanges`).

A call's segments are split into GETs of the engine's task size and run on its pool, one
connection per thread:

- **into host memory** each body is received straight into its slice of the destination;
- **into GPU memory** each body is received into a pair of pinned pieces of
  :data:`PIECE` bytes (borrowed from a pool, one pair per GET in flight): while one piece is
  copied to the device with ``cudaMemcpyAsync``, the next is being received, so a GET's
  last copy is all that is left when its last byte arrives.

Every range lands before the call returns. A GET that failed twice is read through the inner
reader instead (piece by piece into GPU memory). A reader whose GETs could not be pinned to
the version opened is checked once after the last range
(:meth:`~tiering.ranges.RangeReader.check_unchanged`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tiering.ranges import HttpRanges, settle

from ._backends import Staging, StagingPool, _host_view
from ._device import Device, import_cupy

__all__ = ["PIECE", "pairs", "read_segments"]

#: Bytes of one pinned piece of a GET into GPU memory. Measured on the H100 machine (1 GiB from
#: nginx on loopback, 64 connections): 8 MiB pieces, one per GET of 8 MiB, left each GET's
#: whole copy after its last byte; smaller pieces of one GET hide all but the last.
PIECE = 2 << 20


def pairs(limit: int) -> StagingPool:
    """The pool of pinned piece pairs for at most ``limit`` GETs in flight into GPU memory."""
    return StagingPool(PIECE, 2, limit)


class _Pieces:
    """A :class:`~tiering.ranges.Sink` that is a pair of pinned pieces, each copied to
    ``dst_ptr + pos`` on the staging's stream as soon as it is full."""

    def __init__(self, cp: Any, staging: Staging, dst_ptr: int) -> None:
        self._cp, self._st, self._dst = cp, staging, dst_ptr
        self._i = 0

    def view(self, pos: int, left: int) -> memoryview:
        slot = self._i % len(self._st.bufs)
        self._st.wait_slot(slot)  # its last copy out has finished
        return _host_view(self._st.views[slot])[: min(self._st.size, left)]

    def filled(self, pos: int, nbytes: int) -> None:
        slot = self._i % len(self._st.bufs)
        self._st.copy_out(self._cp, slot, self._dst + pos, 0, nbytes)
        self._st.mark(self._cp, slot)
        self._i += 1


def _to_device(
    ranges: HttpRanges, dst_ptr: int, offset: int, nbytes: int, device: Device, pairs: StagingPool
) -> None:
    cp = import_cupy()
    with device.current():
        st = pairs.acquire(cp)
        try:
            sink = _Pieces(cp, st, dst_ptr)

            def again() -> None:  # the whole range through the inner reader, piece by piece
                pos = 0
                while pos < nbytes:
                    view = sink.view(pos, nbytes - pos)
                    ranges.inner.get(view, offset + pos)
                    sink.filled(pos, len(view))
                    pos += len(view)

            ranges.read(offset, nbytes, sink, fallback=again)
        finally:
            st.drain()  # landed, and the pieces free, before the pair goes back
            pairs.release(st)


def read_segments(
    ranges: HttpRanges,
    dst: Any,
    segments: Sequence[tuple[int, int, int]],
    *,
    device: Device,
    pairs: StagingPool,
) -> None:
    """Every ``(file_offset, nbytes, dst_offset)`` of ``ranges`` into flat uint8 ``dst``
    (host or device). Raises what the inner reader raises for a range it could not read
    either (:class:`~tiering.errors.FileChanged` for a replaced object); no range is still
    being written into ``dst`` when it returns or raises."""
    step = ranges.part_size
    tasks = [
        (off + s, min(step, n - s), at + s) for off, n, at in segments for s in range(0, n, step)
    ]
    pool = ranges.pool
    if isinstance(dst, np.ndarray):
        view = _host_view(dst)
        futures = [pool.submit(ranges.get, view[at : at + n], off) for off, n, at in tasks]
    else:
        base = int(dst.data.ptr)
        futures = [
            pool.submit(_to_device, ranges, base + at, off, n, device, pairs)
            for off, n, at in tasks
        ]
    settle(futures)
    if not ranges.pinned:
        ranges.check_unchanged()
