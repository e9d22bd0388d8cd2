"""Remote reads through KvikIO's ``RemoteFile``: a call's segments straight into the
destination (GPU memory through KvikIO's own bounce buffers, host memory directly).

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

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tiering.errors import IntegrityError
from tiering.ranges import KvikioFailed, KvikioRanges

from ._backends import _DevPtr, _host_view

__all__ = ["read_segments"]


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
