"""Rows of row-major ``(rows, dim)`` matrix files: contiguous slices and gathers.

A slice of rows is one contiguous read through the storage's :class:`Transfer`. A gather
(rows in any order, duplicates allowed) is tierd's own I/O whatever the backend: see
:mod:`tiering.io._gather` for how rows are fetched and staged, and
:mod:`tiering.io._remote` for how a remote file's rows are (coalesced ranged reads, no map).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tiering.errors import IndexOutOfRange, InvalidDtype, InvalidInput, InvalidRange

from . import pagecache
from ._checks import flat_target, parse_dtype
from ._config import GdsConfig
from ._copies import CopyFile
from ._device import Device, import_cupy
from ._file import GdsFile
from ._gather import Fill, PinnedPool, gather_rows, local_fill
from ._pools import Pools
from ._remote import RemoteFile
from ._results import ReadResult
from ._stats import IoPath, IoReport, LoadSource, Stats
from ._transfer import Transfer

__all__ = ["Vectors"]


def _matrix(file: GdsFile, dim: int, dtype: Any) -> tuple[np.dtype[Any], int, int]:
    """``(dtype, row bytes, rows)`` of ``file`` read as a ``(rows, dim)`` matrix."""
    dt = parse_dtype(dtype)
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise InvalidInput(f"dim must be a positive integer, got {dim!r}")
    row = int(dim) * dt.itemsize
    if file.size() % row:
        raise InvalidDtype(
            f"{file.size()} bytes is not a whole number of rows of {dim} x {dt} ({row} bytes each)",
            dtype=str(dt),
            dim=int(dim),
        )
    return dt, row, file.size() // row


def _indices(indices: Any, nrows: int) -> np.ndarray:
    """``indices`` (host or device, any shape) as a flat ``intp`` array, all in range."""
    if hasattr(indices, "__cuda_array_interface__"):
        indices = import_cupy().asnumpy(indices)
    idx = np.asarray(indices)
    if idx.size == 0:
        return np.empty(0, dtype=np.intp)
    if idx.dtype.kind not in "iu":
        raise InvalidInput(f"indices must be integers, got dtype {idx.dtype}")
    idx = idx.reshape(-1)
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= nrows:
        bad = lo if lo < 0 else hi
        raise IndexOutOfRange(
            f"row index {bad} is outside the {nrows} row matrix", index=bad, rows=nrows
        )
    return idx.astype(np.intp, copy=False)


class Vectors:
    """The vector reads of one storage; the storage checks that it owns each file first."""

    def __init__(
        self,
        device: Device,
        config: GdsConfig,
        stats: Stats,
        pools: Pools,
        pinned: PinnedPool | None,
        transfer: Transfer,
    ) -> None:
        self._device = device
        self._config = config
        self._stats = stats
        self._pools = pools
        self._pinned = pinned
        self._transfer = transfer

    def read(self, file: GdsFile, start: int, count: int, dim: int, dtype: Any) -> ReadResult:
        """Rows ``start .. start+count``, one contiguous read, as a ``(count, dim)`` array."""
        dt, row, nrows = _matrix(file, dim, dtype)
        for name, v in (("start", start), ("count", count)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise InvalidInput(f"{name} must be an integer, got {v!r}")
        if start < 0 or count < 0 or start + count > nrows:
            raise IndexOutOfRange(
                f"rows [{start}, {start + count}) are outside the {nrows} row matrix",
                rows=nrows,
            )
        n = int(count) * row
        with file.guard() as fd:
            out = self._device.empty(n)
            report = self._transfer.transfer(file, fd, out, 0, int(start) * row, n)
        return ReadResult(out.view(dt).reshape(int(count), int(dim)), report)

    def prefetch(self, file: GdsFile, indices: Any, dim: int, dtype: Any, buffer: Any) -> IoReport:
        """Gather rows ``indices`` into ``buffer``, which must hold exactly that many rows."""
        dt, row, nrows = _matrix(file, dim, dtype)
        idx = _indices(indices, nrows)
        flat = flat_target(self._device, buffer)
        if flat.nbytes != idx.size * row:
            raise InvalidRange(
                f"buffer holds {flat.nbytes} bytes but {idx.size} rows need {idx.size * row}"
            )
        with file.guard() as fd:
            return self._gather(file, fd, idx, row, flat)

    def gather(self, file: GdsFile, indices: Any, dim: int, dtype: Any) -> ReadResult:
        """Gather rows ``indices`` into a new ``(len(indices), dim)`` array."""
        dt, row, nrows = _matrix(file, dim, dtype)
        idx = _indices(indices, nrows)
        with file.guard() as fd:
            out = self._device.empty(idx.size * row)
            report = self._gather(file, fd, idx, row, out)
        return ReadResult(out.view(dt).reshape(idx.size, int(dim)), report)

    def _gather(self, file: GdsFile, fd: int, idx: np.ndarray, row: int, flat: Any) -> IoReport:
        # The gather's I/O is tierd's own (memory map or preadv, or a remote file's ranged
        # reads), whatever the backend.
        io_path: IoPath = "host"
        source: LoadSource = "page_cache"
        if isinstance(file, RemoteFile):
            io_path, source = file.io_path, file.ranges.source
            fill = self._transfer.remote.row_filler(file, row)
        elif isinstance(file, CopyFile):
            io_path, source = file.io_path, file.source
            fill = _copy_fill(file, row)
        else:
            fill = self._local_fill(file, fd, row)
        started = self._stats.begin(io_path, file.tier_key, source)
        ok = False
        try:
            if idx.size:
                gather_rows(
                    fill=fill,
                    idx=idx,
                    row_bytes=row,
                    out=flat,
                    device=self._device,
                    batch_bytes=self._config.prefetch_batch_size,
                    pinned=self._pinned,
                )
            ok = True
        finally:
            nbytes = idx.size * row
            seconds = self._stats.end(io_path, file.tier_key, started, nbytes, ok, source)
        return IoReport(nbytes, io_path, file.tier_key, seconds, source=source)

    def _local_fill(self, file: GdsFile, fd: int, row: int) -> Fill:
        hot = None

        def rows() -> np.ndarray:
            nonlocal hot
            if hot is None and file._map is None:
                hot = pagecache.residency(fd, 0, file.size()) >= self._config.cold_threshold
            return file._rows(populate=bool(hot))

        return local_fill(fd, rows, row, self._pools.aux("gather"), self._config.gather_threads)


def _copy_fill(file: CopyFile, row: int) -> Fill:
    """Rows of a copy held in host memory: one ``take`` (no I/O, no page faults)."""
    matrix = file._rows(populate=False)[: file.size() // row * row].reshape(-1, row)

    def fill(idx: np.ndarray, out: np.ndarray) -> None:
        np.take(matrix, idx, axis=0, out=out.reshape(idx.size, row))

    return fill
