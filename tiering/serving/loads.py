"""Plain loads: one file or byte range into a lease, and batches of them, all or nothing."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiering.errors import TooLarge
from tiering.io import Device, GdsFile, GpuDirectStorage, IoReport
from tiering.io.buffers import alloc_size
from tiering.serving.checks import check_range, check_shape, parse_dtype
from tiering.serving.config import FileRef
from tiering.serving.context import LoadContext, fill
from tiering.serving.leases import Lease, Reservation

__all__ = ["FanOut", "LoadItem", "load_many", "load_one"]


@dataclass(frozen=True)
class LoadItem:
    """One range of a batch load; ``device`` ``None`` takes the batch's."""

    file: FileRef
    offset: int = 0
    length: int | None = None
    dtype: str = "uint8"
    shape: Sequence[int] | None = None
    device: str | None = None


class FanOut:
    """Runs the reads of a batch ``concurrency`` at a time on a pool made at first need.

    ``close()`` ends the pool; a later batch makes a new one.
    """

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def run(self, calls: list[Callable[[], IoReport]]) -> list[IoReport]:
        if len(calls) <= 1:
            return [c() for c in calls]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.concurrency, thread_name_prefix="tierd-load"
                )
            pool = self._pool
        futures = [pool.submit(c) for c in calls]
        errors = [fut.exception() for fut in futures]  # every read ends before buffers go
        for err in errors:
            if err is not None:
                raise err
        return [fut.result() for fut in futures]

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def load_one(
    ctx: LoadContext,
    file: FileRef,
    *,
    offset: int,
    length: int | None,
    device: str | Device,
    dtype: str,
    shape: Sequence[int] | None,
    ttl_s: float | None,
) -> Lease:
    """One range into a new lease; see :meth:`tiering.serving.Loader.load`."""
    dev = ctx.device(device)
    dt = parse_dtype(dtype)
    ctx.leases.ttl(ttl_s)
    storage = ctx.storage(dev)
    with ctx.open(file, storage) as (f, file_id):
        n = check_range(offset, length, f.size())
        shp = check_shape(n, dt, shape)
        with ctx.leases.reserve(dev, alloc_size(dev, n)) as res:
            res.attach(ctx.leases.pool.get(dev, n))
            report = fill(storage, f, offset, res, n)
            lease = ctx.leases.grant(
                res,
                nbytes=n,
                dtype=dt.name,
                shape=shp,
                kind="load",
                file_ids=(file_id,),
                report=report,
                ttl_s=ttl_s,
            )
    ctx.observe("load", dev, report)
    return lease


def load_many(
    ctx: LoadContext,
    fan_out: FanOut,
    items: Sequence[LoadItem],
    *,
    device: str | Device,
    ttl_s: float | None,
) -> list[Lease]:
    """Many ranges at once, all or nothing; see :meth:`tiering.serving.Loader.load_batch`."""
    if len(items) > ctx.config.max_batch_items:
        raise TooLarge(
            f"{len(items)} items is over the limit of {ctx.config.max_batch_items}",
            limit=ctx.config.max_batch_items,
        )
    ctx.leases.ttl(ttl_s)
    prepared: list[
        tuple[
            Device,
            GpuDirectStorage,
            GdsFile,
            int,
            int,
            int,
            np.dtype[Any],
            tuple[int, ...],
            Reservation,
        ]
    ] = []
    leases: list[Lease] = []
    with contextlib.ExitStack() as stack:
        for it in items:
            dev = ctx.device(it.device or device)
            dt = parse_dtype(it.dtype)
            storage = ctx.storage(dev)
            f, file_id = stack.enter_context(ctx.open(it.file, storage))
            n = check_range(it.offset, it.length, f.size())
            shp = check_shape(n, dt, it.shape)
            res = stack.enter_context(ctx.leases.reserve(dev, alloc_size(dev, n)))
            prepared.append((dev, storage, f, file_id, it.offset, n, dt, shp, res))
        for dev, _s, _f, _id, _o, n, *_rest, res in prepared:
            res.attach(ctx.leases.pool.get(dev, n))
        reports = fan_out.run(
            [
                functools.partial(fill, s, f, o, r, n)
                for _d, s, f, _id, o, n, _dt, _shp, r in prepared
            ]
        )
        try:
            for (_dev, _s, _f, file_id, _o, n, dt, shp, res), report in zip(
                prepared, reports, strict=True
            ):
                leases.append(
                    ctx.leases.grant(
                        res,
                        nbytes=n,
                        dtype=dt.name,
                        shape=shp,
                        kind="load",
                        file_ids=(file_id,),
                        report=report,
                        ttl_s=ttl_s,
                    )
                )
        except BaseException:
            ctx.leases.release_many([lease.id for lease in leases])
            raise
    for lease in leases:
        assert lease.report is not None
        ctx.observe("batch", lease.device, lease.report)
    return leases
