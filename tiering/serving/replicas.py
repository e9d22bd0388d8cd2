"""Replicated loads and gathers: one read of storage, the same bytes on several GPUs.

How the bytes travel is chosen per host (:func:`tiering.io.fanout.choose`, setting
``gpu_delivery``):

- **split** (peer access between every pair of GPUs, and peer copies measured faster): every
  device reads its own 1/N of the range from storage at once, each over its own host link,
  then the devices exchange their parts GPU to GPU. Storage and the page cache are read once
  in all; the read runs N links wide.
- **through one device** (no peer access, and gathers, whose rows are scattered): the first
  device is filled by the ordinary single-device load (so it gets everything that path does:
  held copies, residency, the I/O path of its tier); the others get its bytes by peer copy,
  or through one pinned host staging buffer (see :mod:`tiering.io.fanout`).

Every device's budget is reserved before anything is read, so an overrun anywhere reads
nothing and leaves nothing leased.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from tiering.errors import FileChanged, InvalidSharding
from tiering.io import Device, GdsFile
from tiering.io.buffers import alloc_size
from tiering.io.fanout import Delivery, all_gather, choose, fan_out, split
from tiering.serving.checks import check_range, check_shape, parse_dtype
from tiering.serving.config import FileRef
from tiering.serving.context import LoadContext, fill, flat
from tiering.serving.devices import Placed
from tiering.serving.gathers import gather_rows
from tiering.serving.leases import Lease, LeaseSpec, Reservation
from tiering.serving.loads import load_one

__all__ = ["Replica", "gather_to", "replicate", "replicate_range", "same_file"]


@dataclass(frozen=True)
class Replica:
    """One device's lease of a replicated load, and how its bytes came."""

    lease: Lease
    delivery: Delivery


def same_file(files: Sequence[GdsFile]) -> None:
    """Raise :class:`FileChanged` unless the opens of one file for several devices got the same
    bytes: an overwrite between two opens would leave devices with different contents."""
    first = files[0]
    for f in files[1:]:
        if f.size() != first.size() or f.identity() != first.identity():
            raise FileChanged(f"{first.path} changed while it was opened for several devices")


def _devices(placed: Placed) -> list[Device]:
    """The devices of a range or rows load: a sharding splits tensors, which these have not."""
    if placed.sharding is not None:
        raise InvalidSharding("sharding splits safetensors tensors; give devices here")
    return list(placed.devices)


def replicate_range(
    ctx: LoadContext,
    file: FileRef,
    placed: Placed,
    *,
    offset: int,
    length: int | None,
    dtype: str,
    shape: Sequence[int] | None,
    ttl_s: float | None,
    shared: bool = False,
) -> list[Replica]:
    """A range of ``file`` into every device of ``target``; see
    :meth:`tiering.serving.Loader.load`. One device is the plain load (``shared`` too)."""
    if shared:
        placed.alone("shared loads")
    devs = _devices(placed)

    def one(d: Device) -> Lease:
        return load_one(
            ctx,
            file,
            offset=offset,
            length=length,
            device=d,
            dtype=dtype,
            shape=shape,
            ttl_s=ttl_s,
            shared=shared,
        )

    if len(devs) == 1:
        return [Replica(one(devs[0]), "read")]
    how = choose(devs, ctx.config.gpu_delivery)
    if how != "peer":

        def size() -> int:
            return length if length is not None else max(0, ctx.record(file).size - offset)

        return replicate(ctx, devs, nbytes=size, first=one, ttl_s=ttl_s, op="load", how=how)
    dt = parse_dtype(dtype)
    ctx.leases.ttl(ttl_s)
    storages = [ctx.storage(d) for d in devs]
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(ctx.open(file, s)) for s in storages]
        same_file([f for f, _ in opened])
        n = check_range(offset, length, opened[0][0].size())
        shp = check_shape(n, dt, shape)
        reserved = _reserve(ctx, devs, n)
        granted: list[Lease] = []
        try:
            parts = split(n, len(devs))
            started = time.perf_counter()
            calls = [
                (s, f, offset + lo, res, hi - lo, lo)
                for s, (f, _), res, (lo, hi) in zip(storages, opened, reserved, parts, strict=True)
            ]
            reads = storages[0].fan_out(fill, calls)
            all_gather([(d, flat(r, n)) for d, r in zip(devs, reserved, strict=True)], parts)
            seconds = time.perf_counter() - started
            out = []
            for d, res, read, (_f, file_id) in zip(devs, reserved, reads, opened, strict=True):
                report = dataclasses.replace(read, nbytes=n, seconds=seconds)
                spec = LeaseSpec(n, dt.name, shp, "load", (file_id,), report, ttl_s)
                lease = ctx.leases.grant(res, spec)
                granted.append(lease)
                out.append(Replica(lease, "split"))
                ctx.observe("load", d, report)
            return out
        except BaseException:
            for res in reserved:
                res.cancel()  # skips what was granted (see Reservation)
            ctx.leases.release_many([lease.id for lease in granted])
            raise


def gather_to(
    ctx: LoadContext,
    file: FileRef,
    placed: Placed,
    *,
    dim: int,
    dtype: str,
    indices: Sequence[int] | np.ndarray | None,
    start: int | None,
    count: int | None,
    ttl_s: float | None,
) -> list[Replica]:
    """Rows of a matrix file into every device of ``target``; see
    :meth:`tiering.serving.Loader.gather`. The first device gathers the rows (they are
    scattered, so there is no one range to split), the others get them by peer copy or
    through pinned host staging (each Replica says which)."""
    devs = _devices(placed)

    def size() -> int:
        rows = len(indices) if indices is not None else (count or 0)
        return rows * max(0, dim) * parse_dtype(dtype).itemsize

    def first(d: Device) -> Lease:
        return gather_rows(
            ctx,
            file,
            dim=dim,
            dtype=dtype,
            indices=indices,
            start=start,
            count=count,
            device=d,
            ttl_s=ttl_s,
        )

    return replicate(ctx, devs, nbytes=size, first=first, ttl_s=ttl_s, op="gather")


def replicate(
    ctx: LoadContext,
    devs: Sequence[Device],
    *,
    nbytes: Callable[[], int],
    first: Callable[[Device], Lease],
    ttl_s: float | None,
    op: str,
    how: Literal["peer", "host"] | None = None,
) -> list[Replica]:
    """``first(device)`` on the first device, its bytes copied to the others ``how`` (None:
    as :func:`~tiering.io.fanout.choose` says for this host).

    ``nbytes()`` is the load's size, asked before anything is read, to reserve the other
    devices; a first lease of another size (the file changed) re-reserves them.
    """
    if len(devs) == 1:
        return [Replica(first(devs[0]), "read")]
    ctx.leases.ttl(ttl_s)
    others: list[Reservation] = []
    granted: list[Lease] = []
    try:
        n = nbytes()
        others = _reserve(ctx, devs[1:], n)
        lease0 = first(devs[0])
        granted.append(lease0)
        if lease0.nbytes != n:
            for res in others:
                res.cancel()
            others = _reserve(ctx, devs[1:], lease0.nbytes)
        n = lease0.nbytes
        src = lease0.buffer.array()[lease0.offset : lease0.offset + n]
        targets = [(d, flat(res, n)) for d, res in zip(devs[1:], others, strict=True)]
        tier = lease0.report.tier if lease0.report is not None else "copy"
        way = how or choose(devs, ctx.config.gpu_delivery)
        reports = fan_out(src, devs[0], targets, n, tier, way)
        out = [Replica(lease0, "read")]
        for res, report in zip(others, reports, strict=True):
            # On an error below, cancel() skips what was granted (see Reservation).
            spec = LeaseSpec(
                n, lease0.dtype, lease0.shape, lease0.kind, lease0.file_ids, report, ttl_s
            )
            lease = ctx.leases.grant(res, spec)
            granted.append(lease)
            out.append(Replica(lease, way))
            ctx.observe(op, lease.device, report)
        return out
    except BaseException:
        for res in others:
            res.cancel()
        ctx.leases.release_many([lease.id for lease in granted])
        raise


def _reserve(ctx: LoadContext, devs: Sequence[Device], n: int) -> list[Reservation]:
    out: list[Reservation] = []
    try:
        for d in devs:
            res = ctx.leases.reserve(d, alloc_size(d, max(1, n)))
            out.append(res)
            res.attach(ctx.leases.pool.get(d, max(1, n)))
    except BaseException:
        for res in out:
            res.cancel()
        raise
    return out
