"""Plain loads: one file or byte range into a lease, and batches of them, all or nothing.

A ``shared`` load (see :mod:`tiering.serving.residency`) is read-only: a range already
resident on its device is handed out again (the same allocation, no read), and a range that
is not is read into a new read-only buffer that becomes resident for the next shared load.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiering.catalog import FileRecord
from tiering.errors import BufferNotFound, TooLarge
from tiering.io import Device, GdsFile, GpuDirectStorage, IoReport
from tiering.io.buffers import alloc_size
from tiering.serving.checks import check_range, check_shape, parse_dtype
from tiering.serving.config import FileRef
from tiering.serving.context import LoadContext, fill
from tiering.serving.leases import Lease, LeaseSpec, Reservation
from tiering.serving.residency import ResidentKey, authoritative_stat
from tiering.tiers import Stat, Tier

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
    shared: bool = False,
) -> Lease:
    """One range into a new lease; see :meth:`tiering.serving.Loader.load`."""
    if shared:
        item = LoadItem(file, offset, length, dtype, shape, None)
        return load_shared(ctx, None, [item], device=device, ttl_s=ttl_s, op="load")[0]
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
                res, LeaseSpec(n, dt.name, shp, "load", (file_id,), report, ttl_s)
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
    shared: bool = False,
) -> list[Lease]:
    """Many ranges at once, all or nothing; see :meth:`tiering.serving.Loader.load_batch`."""
    if len(items) > ctx.config.max_batch_items:
        raise TooLarge(
            f"{len(items)} items is over the limit of {ctx.config.max_batch_items}",
            limit=ctx.config.max_batch_items,
        )
    if shared:
        return load_shared(ctx, fan_out, items, device=device, ttl_s=ttl_s, op="batch")
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
                spec = LeaseSpec(n, dt.name, shp, "load", (file_id,), report, ttl_s)
                leases.append(ctx.leases.grant(res, spec))
        except BaseException:
            ctx.leases.release_many([lease.id for lease in leases])
            raise
    for lease in leases:
        assert lease.report is not None
        ctx.observe("batch", lease.device, lease.report)
    return leases


# -- shared loads -------------------------------------------------------------------------------
def record_of(ctx: LoadContext, ref: FileRef) -> FileRecord:
    """The record of a file reference, from the read path's cache where it can."""
    if isinstance(ref, int) and not isinstance(ref, bool):
        return ctx.engine.catalog.get(ref, cached=True)
    if isinstance(ref, str):
        return ctx.engine.lookup(ref, cached=True)
    return ctx.record(ref)  # raises the clear error for a bad reference


@dataclass
class _Wanted:
    """One item of a shared load, checked against its catalog record."""

    dev: Device
    rec: FileRecord
    tier: Tier
    offset: int
    n: int
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    key: ResidentKey


@dataclass
class _Fill:
    """A content of a shared load that is not resident: read into a new read-only buffer."""

    want: _Wanted
    stat: Stat | None
    storage: GpuDirectStorage
    file: GdsFile
    res: Reservation
    lease: Lease | None = None


def load_shared(
    ctx: LoadContext,
    fan_out: FanOut | None,
    items: Sequence[LoadItem],
    *,
    device: str | Device,
    ttl_s: float | None,
    op: str,
) -> list[Lease]:
    """Read-only leases of ``items``, all or nothing: resident contents are handed out again
    (see :meth:`~tiering.serving.residency.Residency.find_range`), the others read once each
    (items of one content in the request share its read) and made resident."""
    ctx.leases.ttl(ttl_s)
    wanted = [_want(ctx, it, device) for it in items]
    out: list[Lease | None] = [None] * len(wanted)
    granted: list[Lease] = []
    residency = ctx.residency
    try:
        with residency.claim(w.key for w in wanted), contextlib.ExitStack() as stack:
            pending: list[int] = []
            for i, w in enumerate(wanted):
                hit = _resident(ctx, w, ttl_s)
                if hit is not None:
                    out[i] = hit
                    granted.append(hit)
                else:
                    pending.append(i)
            # One read per content, widest first: a range inside another of the request (the
            # same content, or a part of it) is handed out of that one's buffer.
            fills: dict[ResidentKey, _Fill] = {}
            source: dict[int, tuple[_Fill, int]] = {}
            for i in sorted(pending, key=lambda i: -wanted[i].n):
                w = wanted[i]
                fl = fills.get(w.key) or _covering(fills.values(), w)
                if fl is None:
                    fl = fills[w.key] = _open_fill(ctx, stack, w)
                source[i] = (fl, w.offset - fl.want.offset)
            granted += _read_fills(ctx, fan_out, list(fills.values()), ttl_s)
            handed: set[ResidentKey] = set()
            for i in pending:
                w, (fl, at) = wanted[i], source[i]
                assert fl.lease is not None
                if w.key == fl.want.key and w.key not in handed:
                    handed.add(w.key)
                    out[i] = fl.lease
                    continue
                again = _share(ctx, fl.lease, w, at, ttl_s)
                granted.append(again)
                out[i] = again
    except BaseException:
        ctx.leases.release_many([lease.id for lease in granted])
        raise
    leases = [lease for lease in out if lease is not None]
    for lease in leases:
        assert lease.report is not None
        ctx.observe(op, lease.device, lease.report)
    return leases


def _open_fill(ctx: LoadContext, stack: contextlib.ExitStack, w: _Wanted) -> _Fill:
    # The stat comes first: a change after it shows in a later one (see authoritative_stat).
    stat = authoritative_stat(w.rec, w.tier)
    storage = ctx.storage(w.dev)
    f, _file_id = stack.enter_context(ctx.open(w.rec.id, storage))
    check_range(w.offset, w.n, f.size())
    res = stack.enter_context(ctx.leases.reserve(w.dev, alloc_size(w.dev, w.n)))
    return _Fill(w, stat, storage, f, res)


def _covering(fills: Iterable[_Fill], w: _Wanted) -> _Fill | None:
    """A fill of this request whose range holds ``w``'s, a whole number of items in."""
    for fl in fills:
        f = fl.want
        if (
            f.key.file_id == w.key.file_id
            and f.key.generation == w.key.generation
            and f.dev == w.dev
            and f.offset <= w.offset
            and w.offset + w.n <= f.offset + f.n
            and (w.offset - f.offset) % w.dtype.itemsize == 0
        ):
            return fl
    return None


def _read(fl: _Fill) -> IoReport:
    return fill(fl.storage, fl.file, fl.want.offset, fl.res, fl.want.n)


def _want(ctx: LoadContext, it: LoadItem, device: str | Device) -> _Wanted:
    """One item of a shared batch, checked: its device, record, range, dtype and shape."""
    dev = ctx.device(it.device or device)
    dt = parse_dtype(it.dtype)
    rec = record_of(ctx, it.file)
    n = check_range(it.offset, it.length, rec.size)
    shp = check_shape(n, dt, it.shape)
    tier = ctx.engine.tiers.get(rec.tier)
    return _Wanted(dev, rec, tier, it.offset, n, dt, shp, ResidentKey.bytes(rec, dev, it.offset, n))


def _resident(ctx: LoadContext, w: _Wanted, ttl_s: float | None) -> Lease | None:
    """A lease over a resident copy holding ``w``'s range, or None."""
    found = ctx.residency.find_range(w.rec, w.dev, w.offset, w.n, w.dtype.itemsize, w.tier)
    if found is None:
        return None
    return ctx.residency.grant_shared(
        found[0],
        w.rec,
        kind="load",
        ttl_s=ttl_s,
        offset=found[1],
        nbytes=w.n,
        dtype=w.dtype.name,
        shape=w.shape,
    )


def _read_fills(
    ctx: LoadContext, fan_out: FanOut | None, fills: list[_Fill], ttl_s: float | None
) -> list[Lease]:
    """Read every fill at once, lease each read-only and make it resident; the leases."""
    for fl in fills:
        fl.res.attach(ctx.leases.pool.get(fl.want.dev, fl.want.n))
    calls: list[Callable[[], IoReport]] = [functools.partial(_read, fl) for fl in fills]
    reports = fan_out.run(calls) if fan_out is not None else [c() for c in calls]
    leases = []
    for fl, report in zip(fills, reports, strict=True):
        w = fl.want
        spec = LeaseSpec(w.n, w.dtype.name, w.shape, "load", (w.rec.id,), report, ttl_s)
        fl.lease = ctx.leases.grant(fl.res, spec, read_only=True)
        leases.append(fl.lease)
        if fl.stat is not None:
            ctx.residency.register(w.key, fl.lease, fl.stat)
    return leases


def _share(ctx: LoadContext, lease: Lease, w: _Wanted, at: int, ttl_s: float | None) -> Lease:
    """Another lease over ``lease``'s buffer, for ``w``'s range at ``at`` in it."""
    assert lease.holding is not None
    again = ctx.residency.share(
        lease.holding,
        w.rec,
        kind="load",
        ttl_s=ttl_s,
        offset=at,
        nbytes=w.n,
        dtype=w.dtype.name,
        shape=w.shape,
    )
    if again is None:
        raise BufferNotFound(
            f"buffer {lease.id} expired before the reply; ask for a longer ttl_s",
            buffer_id=lease.id,
        )
    return again
