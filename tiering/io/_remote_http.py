"""Remote reads over tierd's own HTTP connections (:class:`~tiering.ranges.HttpRanges`).

A call's segments, cut by the caller into GETs of the task size, run on ``lanes`` tasks of the
engine's pool, one connection per thread, each lane taking the next GET when its last one is
done:

- **into host memory** each body is received straight into its slice of the destination;
- **into GPU memory** each body is received into a pinned piece of :class:`Stagings` and
  copied to the device with ``cudaMemcpyAsync``; the lane's next GET goes into another piece
  while that copy runs.

Every range lands before the call returns. A GET that failed twice is read through the inner
reader instead (piece by piece into GPU memory). A reader whose GETs could not be pinned to
the version opened is checked once after the last range
(:meth:`~tiering.ranges.RangeReader.check_unchanged`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tiering.ranges import HttpRanges, settle

from ._backends import Staging, _host_view
from ._device import Device, import_cupy

__all__ = ["Segment", "Stagings", "read_if_fast", "read_segments"]

Segment = tuple[int, int, int]
"""``(file_offset, nbytes, dst_offset)``: one range of a file into a flat destination."""


class Stagings:
    """Pinned pieces shared by the engine's threads, each as large as a GET (a body is received
    into one with one ``recv``, then copied out with one ``cudaMemcpyAsync``); at most ``limit``
    of them, made at first need and kept.

    A GET takes the piece filled longest ago whose copy has landed, or makes one while there
    are fewer than ``limit``: the copy of one body then runs while the next body arrives, and a
    GET waits for a copy only when every piece is still being copied. Pinned memory is at most
    ``limit`` pieces, however many threads have read.

    Measured on the H100 machine (1 GiB from nginx on loopback, 64 connections of 8 MiB): a
    body received in pieces of 4 or 2 MiB read 0.92x and 0.70x as fast, since each ``recv``
    that returns must take the GIL back; and a thread that waited for its copy before its next
    GET read 0.93x as fast as one with a second piece.
    """

    def __init__(self, piece: int, limit: int) -> None:
        self.piece, self.limit = piece, limit
        self._ready = threading.Condition()
        self._idle: deque[Staging] = deque()  # given back, in the order they were filled
        self._made = 0

    def take(self, cp: Any) -> Staging:
        """A piece whose last copy has landed (the device must be current)."""
        st: Staging | None = None
        with self._ready:
            while True:
                for idle in self._idle:
                    ev = idle.events[0]
                    if ev is None or ev.done:
                        self._idle.remove(idle)
                        return idle
                if self._made < self.limit:
                    self._made += 1
                    break
                if self._idle:
                    st = self._idle.popleft()  # the one filled first: its copy ends first
                    break
                self._ready.wait()  # every piece is being filled
        if st is None:
            return Staging(cp, self.piece, 1)
        st.wait_slot(0)
        return st

    def give(self, st: Staging) -> None:
        """``st`` is filled, its copy queued (or it was not used): another GET may take it."""
        with self._ready:
            self._idle.append(st)
            self._ready.notify()


class _Pieces:
    """A :class:`~tiering.ranges.Sink` that is pinned pieces of :class:`Stagings`, each copied
    to ``dst_ptr + pos`` as soon as it is full. A piece is taken once the response's head is
    in, so a wait for an earlier copy overlaps the body's first bytes; one taken by a GET that
    failed is used by its next try, and given back by :meth:`close`."""

    def __init__(self, cp: Any, stagings: Stagings, dst_ptr: int, used: list[Staging]) -> None:
        self._cp, self._stagings, self._dst, self._used = cp, stagings, dst_ptr, used
        self._st: Staging | None = None

    def view(self, pos: int, left: int) -> memoryview:
        if self._st is None:
            self._st = self._stagings.take(self._cp)
        st = self._st
        return _host_view(st.views[0])[: min(st.size, left)]

    def filled(self, pos: int, nbytes: int) -> None:
        st, self._st = self._st, None
        assert st is not None
        self._used.append(st)  # before the copy is queued: the read waits for it, come what may
        try:
            st.copy_out(self._cp, 0, self._dst + pos, 0, nbytes)
            st.mark(self._cp, 0)
        finally:
            self._stagings.give(st)

    def close(self) -> None:
        if self._st is not None:
            self._stagings.give(self._st)
            self._st = None


def _to_device(
    ranges: HttpRanges,
    dst_ptr: int,
    offset: int,
    nbytes: int,
    device: Device,
    stagings: Stagings,
    used: list[Staging],
) -> None:
    cp = import_cupy()
    device.make_current()  # the engine's threads serve this device only: no need to restore
    sink = _Pieces(cp, stagings, dst_ptr, used)

    def again() -> None:  # the whole range through the inner reader, piece by piece
        pos = 0
        while pos < nbytes:
            view = sink.view(pos, nbytes - pos)
            ranges.inner.get(view, offset + pos)
            sink.filled(pos, len(view))
            pos += len(view)

    try:
        ranges.read(offset, nbytes, sink, fallback=again)
    finally:
        sink.close()


def read_segments(
    ranges: HttpRanges,
    dst: Any,
    segments: Sequence[Segment],
    *,
    lanes: int,
    device: Device,
    stagings: Stagings,
) -> None:
    """Every ``(file_offset, nbytes, dst_offset)`` of ``ranges`` into flat uint8 ``dst``
    (host or device), one GET each (the caller cuts them to the task size), at most ``lanes``
    at once. Raises what the inner reader raises for a range it could not read either
    (:class:`~tiering.errors.FileChanged` for a replaced object); no range is still being
    written into ``dst`` when it returns or raises."""
    if isinstance(dst, np.ndarray):
        view = _host_view(dst)
        _in_lanes(ranges, lanes, segments, lambda off, n, at: ranges.get(view[at : at + n], off))
    else:
        base = int(dst.data.ptr)
        used: list[Staging] = []
        try:
            _in_lanes(
                ranges,
                lanes,
                segments,
                lambda off, n, at: _to_device(ranges, base + at, off, n, device, stagings, used),
            )
        finally:  # every copy of this read landed (and maybe a later one into the same piece)
            for st in {id(st): st for st in used}.values():
                st.stream.synchronize()
    if not ranges.pinned:
        ranges.check_unchanged()


def _in_lanes(
    ranges: HttpRanges,
    lanes: int,
    segments: Sequence[Segment],
    one: Callable[[int, int, int], None],
) -> None:
    """``one(*segment)`` for every segment, on at most ``lanes`` tasks of the reader's pool that
    each take the next segment until none is left: GETs in flight are bounded whatever the
    segments' count, and a slow GET holds up no other. After a failure no lane starts another
    GET; the first error is raised once every lane has stopped."""
    lock = threading.Lock()
    todo = iter(segments)
    failed = threading.Event()

    def lane() -> None:
        while not failed.is_set():
            with lock:
                seg = next(todo, None)
            if seg is None:
                return
            try:
                one(*seg)
            except BaseException:
                failed.set()
                raise

    settle([ranges.pool.submit(lane) for _ in range(max(1, min(lanes, len(segments))))])


def read_if_fast(
    ranges: HttpRanges,
    dst: Any,
    segments: Sequence[Segment],
    *,
    device: Device,
    stagings: Stagings,
) -> Sequence[Segment]:
    """All of ``segments`` where ``ranges``' origin is a fast one, in GETs of twice the task size
    on half the connections (:meth:`~tiering.ranges.HttpReads.plan`). An origin not judged yet
    is judged by the read's first GET of the task size, sent alone into its place
    (:meth:`~tiering.ranges.HttpReads.judge`): no byte is read twice. Returns the segments still
    to read: none, all (a paced origin, or nothing to judge by yet), or all but that GET."""
    reads = ranges.reads
    fast = reads.known(ranges)
    if fast is None:
        first, rest = _first_get(segments, reads.task_size)
        if not first:
            return segments
        if not isinstance(dst, np.ndarray):
            # A pinned piece made now, not inside the timed GET: cudaHostAlloc costs
            # milliseconds, as much as the GET itself from a fast origin.
            cp = import_cupy()
            device.make_current()
            stagings.give(stagings.take(cp))
        started = time.perf_counter()
        read_segments(ranges, dst, first, lanes=1, device=device, stagings=stagings)
        fast = reads.judge(ranges, reads.task_size, time.perf_counter() - started)
        segments = rest
    if not fast or not segments:
        return segments
    size, lanes = reads.plan(True)
    read_segments(
        ranges, dst, _split(segments, size), lanes=lanes, device=device, stagings=stagings
    )
    return []


def _first_get(segments: Sequence[Segment], size: int) -> tuple[list[Segment], list[Segment]]:
    """The first ``size`` bytes of the first segment that holds them, and every other byte;
    ``([], segments)`` when no segment does."""
    for i, (off, n, at) in enumerate(segments):
        if n >= size:
            tail = [(off + size, n - size, at + size)] if n > size else []
            return [(off, size, at)], [*segments[:i], *tail, *segments[i + 1 :]]
    return [], list(segments)


def _split(segments: Sequence[Segment], piece: int) -> list[Segment]:
    """``segments`` with every one longer than ``piece`` cut into pieces of at most that."""
    out: list[Segment] = []
    for off, n, at in segments:
        for k in range(0, n, piece) if n > piece else (0,):
            out.append((off + k, min(piece, n - k), at + k))
    return [s for s in out if s[1] > 0]
