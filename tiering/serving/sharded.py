"""Safetensors loads into several devices: replicas, and tensor-parallel slices by rank.

``devices`` without ``sharding``: every device gets every selected tensor. Storage is read
once, into the first device; the others get the bytes by peer copy, or through one pinned
host staging buffer where peer access is off (see :mod:`tiering.io._fanout`).

With ``sharding`` (see :mod:`tiering.io.sharding`): rank ``k`` gets its slice of each tensor
a rule matches and all of the others. ``rank=None`` loads every rank, one device per rank;
``rank=k`` loads that rank into its one device (a worker asking for itself; ``cpu`` too).
Each rank reads only its own bytes from storage, straight into its device:

- a dim-0 slice (and a replicated tensor) is one contiguous range;
- a slice along ``dim > 0`` is one row segment per outer index. Segments of at least
  :data:`STRIDED_MIN_SEGMENT` bytes are read as they are (strided reads: only the slice's
  bytes move); smaller ones would be many tiny reads, so the whole tensor is read once into
  a transient buffer on the device and the slice copied out of it there (``world_size``
  times the bytes, one large read). The transient buffer is outside the lease budget and
  lives for one tensor.

Every buffer on every device is reserved before the first byte is read, so a load over any
device's budget fails with nothing read and nothing left leased anywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiering.errors import InvalidInput, InvalidSharding, TooLarge
from tiering.io import Device, GdsFile, GpuDirectStorage, IoReport
from tiering.io._fanout import Delivery, fan_out
from tiering.io.buffers import alloc_size
from tiering.io.safetensors import DTYPES, TensorInfo, parse_header, select_tensors
from tiering.io.sharding import (
    ShardingSpec,
    TensorSlice,
    byte_ranges,
    check_rank,
    check_spec,
    cut_whole,
    parse_sharding,
    slice_of,
    whole_range,
)
from tiering.serving.config import FileRef
from tiering.serving.context import LoadContext
from tiering.serving.devices import parse_devices
from tiering.serving.leases import Lease, Reservation
from tiering.serving.safetensors import TensorsLoaded, load_shards, loaded

__all__ = ["STRIDED_MIN_SEGMENT", "DeviceLoaded", "load_devices"]

#: Row segments at least this long are read in place; shorter ones come from one read of the
#: whole tensor, sliced on the device. At 256 KiB a read costs far more in transfer than in
#: setup on NVMe and the page cache; ``tierd bench multi-gpu`` measures both ways.
STRIDED_MIN_SEGMENT = 256 << 10
_SLOT = 256  # alignment of each tensor in a buffer: enough for any dtype


@dataclass(frozen=True)
class DeviceLoaded:
    """One device's part of a multi-device load: its leases and tensors, its rank (None:
    no sharding), and how its bytes came (``read``, ``peer`` or ``host``)."""

    device: Device
    rank: int | None
    loaded: TensorsLoaded
    delivery: Delivery


@dataclass(frozen=True)
class _Piece:
    info: TensorInfo
    part: TensorSlice
    at: int  # byte offset in the shard's buffer


@dataclass
class _Plan:
    """One shard's buffer on one device."""

    pieces: list[_Piece] = field(default_factory=list)
    nbytes: int = 0


def _plan(infos: Sequence[TensorInfo], spec: ShardingSpec | None, rank: int | None) -> _Plan:
    plan = _Plan()
    for t in sorted(infos, key=lambda t: t.begin):
        size = np.dtype(DTYPES[t.dtype].storage).itemsize
        if spec is None or rank is None:
            part = TensorSlice(t.name, None, 0, 0, t.shape, (0,) * len(t.shape), t.shape, size)
        else:
            part = slice_of(spec, t.name, t.shape, size, rank)
        at = -(-plan.nbytes // _SLOT) * _SLOT
        plan.pieces.append(_Piece(t, part, at))
        plan.nbytes = at + part.nbytes
    return plan


def _ranks(spec: ShardingSpec | None, rank: int | None, devs: Sequence[Device]) -> list[int | None]:
    if spec is None:
        if rank is not None:
            raise InvalidSharding("rank needs a sharding spec")
        return [None] * len(devs)
    if rank is None:
        if len(devs) != spec.world_size:
            raise InvalidSharding(
                f"a load of every rank needs one device per rank: world_size "
                f"{spec.world_size}, {len(devs)} device(s); or ask for one rank with rank=k",
                world_size=spec.world_size,
                devices=len(devs),
            )
        return list(range(spec.world_size))
    check_rank(spec, rank)
    if len(devs) != 1:
        raise InvalidSharding(
            f"rank={rank} loads one rank into one device; {len(devs)} devices were named"
        )
    return [rank]


def load_devices(
    ctx: LoadContext,
    files: Sequence[FileRef],
    *,
    names: Sequence[str] | None,
    devices: str | Sequence[str | Device],
    sharding: ShardingSpec | Mapping[str, Any] | None,
    rank: int | None,
    ttl_s: float | None,
) -> list[DeviceLoaded]:
    """See :meth:`tiering.serving.Loader.load_safetensors` (``devices``, ``sharding``)."""
    if not files:
        raise InvalidInput("name at least one file")
    if len(files) > ctx.config.max_batch_items:
        raise TooLarge(
            f"{len(files)} files is over the limit of {ctx.config.max_batch_items}",
            limit=ctx.config.max_batch_items,
        )
    devs = parse_devices(ctx, devices)
    spec = None if sharding is None else parse_sharding(sharding)
    ranks = _ranks(spec, rank, devs)
    ctx.leases.ttl(ttl_s)
    if spec is None and len(devs) == 1:
        one = load_shards(ctx, files, names=names, device=devs[0], ttl_s=ttl_s)
        return [DeviceLoaded(devs[0], None, one, "read")]
    # Replicas read storage into the first device only; every rank reads its own slices.
    readers = devs if spec is not None else devs[:1]
    with contextlib.ExitStack() as stack:
        opened = [
            [stack.enter_context(ctx.open(ref, ctx.storage(d))) for ref in files] for d in readers
        ]
        headers = []
        for f, _id in opened[0]:
            with f._use():
                headers.append(parse_header(f.path, f.size(), f.read_bytes))
        chosen = select_tensors(headers, names)
        infos = [[h.tensors[n] for n in picked] for h, picked in zip(headers, chosen, strict=True)]
        if spec is not None:
            check_spec(spec, {t.name: t.shape for shard in infos for t in shard})
        plans = [[_plan(shard, spec, r) for shard in infos] for r in ranks]
        return _run(ctx, devs, ranks, readers, opened, plans, infos, ttl_s, sharded=bool(spec))


def _run(
    ctx: LoadContext,
    devs: list[Device],
    ranks: list[int | None],
    readers: list[Device],
    opened: list[list[tuple[GdsFile, int]]],
    plans: list[list[_Plan]],
    infos: list[list[TensorInfo]],
    ttl_s: float | None,
    *,
    sharded: bool,
) -> list[DeviceLoaded]:
    shards = [i for i, shard in enumerate(infos) if shard]
    reserved: dict[tuple[int, int], Reservation] = {}
    granted: list[Lease] = []
    try:
        for k, d in enumerate(devs):  # every budget first: an overrun reads nothing
            for i in shards:
                n = max(1, plans[k][i].nbytes)
                res = reserved[(k, i)] = ctx.leases.reserve(d, alloc_size(d, n))
                res.attach(ctx.leases.pool.get(d, n))
        reports: dict[tuple[int, int], IoReport] = {}
        how: list[Delivery] = ["read"] * len(devs)
        for k, d in enumerate(readers):
            storage = ctx.storage(d)
            calls = [(storage, opened[k][i][0], reserved[(k, i)], plans[k][i]) for i in shards]
            for i, rep in zip(shards, storage._fan_out(_read_plan, calls), strict=True):
                reports[(k, i)] = rep
        if len(readers) < len(devs):  # replicas: from the first device to the others
            for i in shards:
                src = reserved[(0, i)].buffer
                assert src is not None
                n = plans[0][i].nbytes
                targets = [(devs[k], _flat(reserved[(k, i)], n)) for k in range(1, len(devs))]
                way, reps = fan_out(_flat(reserved[(0, i)], n), devs[0], targets, n, "copy")
                for k, rep in enumerate(reps, start=1):
                    reports[(k, i)], how[k] = rep, way
        out = []
        for k, d in enumerate(devs):
            leases = []
            for i in shards:
                res = reserved.pop((k, i))
                lease = _grant(
                    ctx, res, plans[k][i], opened[0][i][1], reports[(k, i)], ttl_s, sharded=sharded
                )
                granted.append(lease)
                leases.append(lease)
            out.append(DeviceLoaded(d, ranks[k], loaded(ctx, d, leases), how[k]))
        return out
    except BaseException:
        ctx.leases.release_many([lease.id for lease in granted])
        for res in reserved.values():
            res.cancel()
        raise


def _flat(res: Reservation, n: int) -> Any:
    assert res.buffer is not None
    return res.buffer.array()[:n]


def _read_plan(storage: GpuDirectStorage, f: GdsFile, res: Reservation, plan: _Plan) -> IoReport:
    """Read one shard's pieces into its reservation's buffer; see the module docstring."""
    storage.device.make_current()
    buf = _flat(res, plan.nbytes)
    reads: list[tuple[int, int, int]] = []
    cuts: list[_Piece] = []
    for p in plan.pieces:
        if p.part.nbytes == 0:
            continue
        if p.part.dim in (None, 0) or p.part.segment_bytes >= STRIDED_MIN_SEGMENT:
            at = p.at
            for off, n in byte_ranges(p.part, p.info.begin):
                reads.append((off, n, at))
                at += n
        else:
            cuts.append(p)
    parts: list[IoReport] = []
    with f._use() as fd:
        if reads:
            parts.append(storage._transfer_ranges(f, fd, buf, reads))
        for p in cuts:
            off, n = whole_range(p.part, p.info.begin)
            whole = storage.device.empty(n)
            parts.append(storage._transfer_ranges(f, fd, whole, [(off, n, 0)]))
            view = cut_whole(p.part, whole)
            buf[p.at : p.at + p.part.nbytes].reshape(view.shape)[...] = view
    assert res.buffer is not None
    res.buffer.synchronize()
    if not parts:
        return IoReport(0, f.io_path, f.tier_key, 0.0, source=getattr(f, "source", "page_cache"))
    first = parts[0]
    return IoReport(
        sum(r.nbytes for r in parts),
        first.io_path,
        first.tier,
        sum(r.seconds for r in parts),
        cold=any(r.cold for r in parts),
        engine=first.engine,
        source=first.source,
    )


def _grant(
    ctx: LoadContext,
    res: Reservation,
    plan: _Plan,
    file_id: int,
    report: IoReport,
    ttl_s: float | None,
    *,
    sharded: bool,
) -> Lease:
    layout: dict[str, Any] = {}
    for p in plan.pieces:
        entry: dict[str, Any] = {
            "offset": p.at,
            "dtype": p.info.dtype,
            "shape": list(p.part.shape),
            "nbytes": p.part.nbytes,
        }
        if sharded:
            entry["full_shape"] = list(p.part.full_shape)
            entry["slice_offset"] = list(p.part.offset)
        layout[p.info.name] = entry
    return ctx.leases.grant(
        res,
        nbytes=plan.nbytes,
        dtype="uint8",
        shape=(plan.nbytes,),
        kind="safetensors",
        file_ids=(file_id,),
        report=report,
        ttl_s=ttl_s,
        tensors=layout,
    )
