"""Remote reads over tierd's own HTTP connections (:class:`~tiering.ranges.HttpRanges`).

A call's segments are split into GETs of the engine's task size and run on its pool, one
connection per thread:

- **into host memory** each body is received straight into its slice of the destination;
- **into GPU memory** each body is received into one of the thread's pinned pieces
  (:mod:`tiering.io._landing`) and copied to the device with ``cudaMemcpyAsync``; the
  thread's next GET goes into its other piece while that copy runs.

Every range lands before the call returns. A GET that failed twice is read through the inner
reader instead (piece by piece into GPU memory). A reader whose GETs could not be pinned to
the version opened is checked once after the last range
(:meth:`~tiering.ranges.RangeReader.check_unchanged`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tiering.ranges import HttpRanges, Sink, settle

from ._backends import _host_view
from ._device import Device
from ._landing import Stagings, again, tasks_of, to_device

__all__ = ["read_segments"]


def read_segments(
    ranges: HttpRanges,
    dst: Any,
    segments: Sequence[tuple[int, int, int]],
    *,
    device: Device,
    stagings: Stagings,
) -> None:
    """Every ``(file_offset, nbytes, dst_offset)`` of ``ranges`` into flat uint8 ``dst``
    (host or device). Raises what the inner reader raises for a range it could not read
    either (:class:`~tiering.errors.FileChanged` for a replaced object); no range is still
    being written into ``dst`` when it returns or raises."""
    if isinstance(dst, np.ndarray):
        view = _host_view(dst)
        tasks = tasks_of(segments, ranges.part_size)
        settle([ranges.pool.submit(ranges.get, view[at : at + n], off) for off, n, at in tasks])
    else:

        def fill(offset: int, nbytes: int, sink: Sink) -> None:
            ranges.read(
                offset, nbytes, sink, fallback=lambda: again(ranges.inner, offset, nbytes, sink)
            )

        to_device(fill, dst, segments, pool=ranges.pool, device=device, stagings=stagings)
    if not ranges.pinned:
        ranges.check_unchanged()
