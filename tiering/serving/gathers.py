"""Gathers: rows of a row-major matrix file, by index list or by start and count, into a lease."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tiering.errors import IndexOutOfRange, InvalidDtype, InvalidInput, TooLarge
from tiering.io import Device, IoReport
from tiering.io.buffers import alloc_size
from tiering.serving.checks import parse_dtype
from tiering.serving.config import FileRef
from tiering.serving.context import LoadContext, fill
from tiering.serving.leases import Lease, LeaseSpec

__all__ = ["gather_rows"]


def gather_rows(
    ctx: LoadContext,
    file: FileRef,
    *,
    dim: int,
    dtype: str,
    indices: Sequence[int] | np.ndarray | None,
    start: int | None,
    count: int | None,
    device: str | Device,
    ttl_s: float | None,
) -> Lease:
    """Rows of a ``(rows, dim)`` matrix file; see :meth:`tiering.serving.Loader.gather`."""
    by_index = indices is not None
    if by_index == (start is not None or count is not None) or (
        not by_index and (start is None or count is None)
    ):
        raise InvalidInput("give either indices, or start and count")
    if indices is not None and len(indices) > ctx.config.max_gather_indices:
        raise TooLarge(
            f"{len(indices)} indices is over the limit of {ctx.config.max_gather_indices}",
            limit=ctx.config.max_gather_indices,
        )
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise InvalidInput(f"dim must be a positive integer, got {dim!r}")
    dev = ctx.device(device)
    dt = parse_dtype(dtype)
    ctx.leases.ttl(ttl_s)
    storage = ctx.storage(dev)
    with ctx.open(file, storage, copies="host") as (f, file_id):
        row = dim * dt.itemsize
        if f.size() % row:
            raise InvalidDtype(
                f"{f.size()} bytes is not a whole number of rows of {dim} x {dt.name} "
                f"({row} bytes each)",
                dtype=dt.name,
                dim=dim,
            )
        nrows = f.size() // row
        idx: np.ndarray | None = None
        if indices is not None:
            try:
                idx = np.asarray(indices, dtype=np.int64).reshape(-1)
            except (TypeError, ValueError, OverflowError) as exc:
                raise InvalidInput(f"indices must be integers: {exc}") from exc
            if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= nrows):
                bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
                raise IndexOutOfRange(
                    f"row index {bad} is outside the {nrows} row matrix", index=bad, rows=nrows
                )
            rows = int(idx.size)
        else:
            assert start is not None and count is not None
            if start < 0 or count < 0 or start + count > nrows:
                raise IndexOutOfRange(
                    f"rows [{start}, {start + count}) are outside the {nrows} row matrix",
                    rows=nrows,
                )
            rows = count
        n = rows * row
        with ctx.leases.reserve(dev, alloc_size(dev, n)) as res:
            buf = res.attach(ctx.leases.pool.get(dev, n))
            if n == 0:
                report = IoReport(0, "remote" if f.io_path == "remote" else "host", f.tier_key, 0.0)
            elif idx is not None:
                with storage.device.current():
                    report = storage.prefetch_vectors(f, idx, dim, dt, buf.array()[:n])
                    buf.synchronize()
            else:
                assert start is not None
                report = fill(storage, f, start * row, res, n)
            spec = LeaseSpec(n, dt.name, (rows, dim), "gather", (file_id,), report, ttl_s)
            lease = ctx.leases.grant(res, spec)
    ctx.observe("gather", dev, report)
    return lease
