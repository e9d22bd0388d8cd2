"""Remote reads through KvikIO's ``RemoteFile``: a call's segments straight into host memory;
into GPU memory, a task at a time into pinned pieces, each copied to the device as soon as it
has landed (:mod:`tiering.io._landing`).

**Why not KvikIO's own path into GPU memory.** There, each task's bytes go from curl's buffer
into a bounce buffer, and the thread copies that to the device and waits for the copy before
its next GET. Read into host memory, KvikIO took 1.06-1.19x less time for the same object in
every run on the H100 machine (1 GiB from nginx on loopback, in turns). Reading each task into
pinned host memory by KvikIO and queuing its copy at once, from a Python thread that sleeps in
``IOFuture.get`` meanwhile, keeps the faster path and overlaps the copies with the transfer.

:class:`~tiering.io._remote.RemoteReads` hands a call here when
:meth:`KvikioReads.wins <tiering.ranges.KvikioReads.wins>` says KvikIO wins for the file's
:class:`~tiering.ranges.RangeReader`; the URL, its renewal and KvikIO's pool live in
:mod:`tiering.ranges._kvikio`. KvikIO cannot send ``If-Match``: after the last range has
landed the reader checks that the bytes opened are still there
(:meth:`~tiering.ranges.RangeReader.check_unchanged`), and a changed object raises
:class:`~tiering.errors.FileChanged`: the caller discards the buffer, as it does when an
``If-Match`` GET fails.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import numpy as np

from tiering.errors import IntegrityError
from tiering.ranges import KvikioFailed, KvikioRanges, Sink

from ._backends import _DevPtr, _host_view
from ._device import Device
from ._landing import Stagings, to_device

__all__ = ["read_segments", "read_staged"]

log = logging.getLogger("tiering.io")


def read_segments(path: Path, ranges: KvikioRanges, dst: Any, segments: Sequence[Any]) -> None:
    """Every ``(file_offset, nbytes, dst_offset)`` of ``ranges`` into flat uint8 ``dst``.

    Raises :class:`~tiering.errors.FileChanged` when the object was replaced (whatever else
    failed), :class:`~tiering.ranges.KvikioFailed` for any other failure of KvikIO. No range
    is still being written into ``dst`` when it returns or raises.
    """
    remote = ranges.handle()  # FileChanged if replaced since the open
    host = isinstance(dst, np.ndarray)
    flat = np.frombuffer(_host_view(dst), dtype=np.uint8) if host else None
    futures: list[tuple[int, int, Any]] = []
    failure: BaseException | None = None
    try:
        for off, n, at in segments:
            if n <= 0:
                continue
            buf = flat[at : at + n] if flat is not None else _DevPtr(dst, at, n)
            futures.append((off, n, remote.pread(buf, n, off)))
    except Exception as exc:
        failure = exc
    for off, n, fut in futures:  # every one, even after a failure: none may still write
        try:
            got = int(fut.get())
        except Exception as exc:
            failure = failure or exc
            continue
        if got != n and failure is None:
            failure = IntegrityError(
                f"{path}: only {got} of {n} bytes at offset {off} could be read", offset=off
            )
    ranges.check_unchanged()  # the bytes are in: were they the ones opened?
    if failure is not None:
        raise KvikioFailed(f"{type(failure).__name__}: {failure}") from failure


def read_staged(
    path: Path,
    ranges: KvikioRanges,
    dst: Any,
    segments: Sequence[Any],
    *,
    pool: Executor,
    device: Device,
    stagings: Stagings,
) -> None:
    """Every segment of ``ranges`` into device array ``dst`` (see the module): each task read
    by KvikIO into a pinned piece, then copied. A task KvikIO failed is read again through the
    inner reader; :class:`~tiering.errors.FileChanged` when the object was replaced."""
    ranges.handle()  # KvikioFailed here (the caller reads another way), FileChanged if replaced

    def fill(offset: int, nbytes: int, sink: Sink) -> None:
        view = sink.view(0, nbytes)  # a task is at most a piece
        try:
            got = int(ranges.pread(np.frombuffer(view, np.uint8), nbytes, offset).get())
        except Exception as exc:  # libcurl's failures come as RuntimeError
            log.info("%s: KvikIO read at %d failed (%s); reading it again", path, offset, exc)
            got = -1
        if got != nbytes:
            ranges.inner.get(view, offset)
        sink.filled(0, nbytes)

    to_device(fill, dst, segments, pool=pool, device=device, stagings=stagings)
    ranges.check_unchanged()  # the bytes are in: were they the ones opened?
