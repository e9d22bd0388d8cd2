"""Safetensors loads into the devices of a :class:`~tiering.io.target.LoadTarget`: replicas,
and tensor-parallel slices by rank (one device without sharding is the plain load).

Several devices without a sharding: every device gets every selected tensor, storage read
once. Where every pair of GPUs has peer access (see :func:`tiering.io.fanout.choose`), each
device reads its own 1/N of every shard's buffer, all at once over their own host links, and
the devices then exchange their parts GPU to GPU (delivery ``split``); elsewhere the first
device reads everything and the others get it through one pinned host staging buffer.

With a sharding (see :mod:`tiering.io.sharding`): rank ``k`` gets its slice of each tensor
a rule matches and all of the others; the target says which rank each device loads (every
rank, one device per rank; or its ``rank``, into its one device: a worker asking for itself,
``cpu`` too). The slices of every rank are computed once (:func:`tiering.io.sharding.split`)
and read as they say. Each rank reads only its own bytes from storage, straight into its
device, and all ranks read at once. A tensor no rule matches goes whole to every rank; in a
load of every rank with peer access between the GPUs it is read from storage once, by one
rank, and copied GPU to GPU to the others. Slices are read:

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
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiering.io import Device, GdsFile, GpuDirectStorage, IoReport
from tiering.io.buffers import alloc_size
from tiering.io.fanout import Delivery, PeerCopy, all_gather, choose, fan_out, peer_copies, split
from tiering.io.safetensors import DTYPES, TensorInfo, parse_header, select_tensors
from tiering.io.sharding import TensorSlice
from tiering.io.sharding import split as split_tensors
from tiering.serving.config import FileRef
from tiering.serving.context import LoadContext, flat
from tiering.serving.devices import Placed
from tiering.serving.leases import Lease, LeaseSpec, Reservation
from tiering.serving.replicas import same_file
from tiering.serving.safetensors import Select, TensorsLoaded, check_batch, load_shards, loaded

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


def _plan(infos: Sequence[TensorInfo], slices: dict[str, TensorSlice]) -> _Plan:
    """One shard's buffer: its tensors' slices (of one rank) packed in file order."""
    plan = _Plan()
    for t in sorted(infos, key=lambda t: t.begin):
        part = slices[t.name]
        at = -(-plan.nbytes // _SLOT) * _SLOT
        plan.pieces.append(_Piece(t, part, at))
        plan.nbytes = at + part.nbytes
    return plan


def load_devices(
    ctx: LoadContext,
    files: Sequence[FileRef],
    placed: Placed,
    *,
    names: Sequence[str] | None,
    ttl_s: float | None,
    shared: bool = False,
    select: Select | None = None,
    wait: bool = True,
) -> list[DeviceLoaded]:
    """Tensors of safetensors shards into the devices ``placed`` names, one entry per device;
    see :meth:`tiering.serving.Loader.load_safetensors`. One device without sharding is the
    plain load (:func:`~tiering.serving.safetensors.load_shards`, ``shared`` and ``select``
    as there; ``select`` checks the opened shards and chooses the tensors, with ``names``
    None; ``wait`` false lets it reply before its copies land)."""
    check_batch(ctx, files)
    if shared:
        placed.alone("shared loads")
    devs, ranks, spec = list(placed.devices), list(placed.ranks), placed.sharding
    ctx.leases.ttl(ttl_s)
    if spec is None and len(devs) == 1:
        one = load_shards(
            ctx,
            files,
            names=names,
            device=devs[0],
            ttl_s=ttl_s,
            select=select,
            shared=shared,
            wait=wait,
        )
        return [DeviceLoaded(devs[0], None, one, "read")]
    # Every rank reads its own slices; replicas split the reads over every device, or read
    # into the first device only where the GPUs cannot copy to each other.
    how: Delivery = "read"
    peer = len(devs) > 1 and choose(devs, ctx.config.gpu_delivery) == "peer"
    if spec is None:
        how = "split" if peer else "host"
    readers = devs[:1] if how == "host" else devs
    with contextlib.ExitStack() as stack:
        opened = [
            [stack.enter_context(ctx.open(ref, ctx.storage(d))) for ref in files] for d in readers
        ]
        for i in range(len(files)):
            same_file([o[i][0] for o in opened])
        if select is not None:
            names = select([f for f, _id in opened[0]])
        headers = []
        for f, _id in opened[0]:
            with f.guard():
                headers.append(parse_header(f.path, f.size(), f.read_bytes))
        chosen = select_tensors(headers, names)
        infos = [[h.tensors[n] for n in picked] for h, picked in zip(headers, chosen, strict=True)]
        # Every rank's slice of every tensor, the spec checked against the tensors once.
        sizes = {
            t.name: (t.shape, np.dtype(DTYPES[t.dtype].storage).itemsize)
            for shard in infos
            for t in shard
        }
        slices = split_tensors(spec, sizes, ranks)
        plans = [[_plan(shard, mine) for shard in infos] for mine in slices]
        return _run(
            ctx, devs, ranks, how, opened, plans, infos, ttl_s, sharded=bool(spec), peer=peer
        )


def _run(
    ctx: LoadContext,
    devs: list[Device],
    ranks: list[int | None],
    how: Delivery,
    opened: list[list[tuple[GdsFile, int]]],
    plans: list[list[_Plan]],
    infos: list[list[TensorInfo]],
    ttl_s: float | None,
    *,
    sharded: bool,
    peer: bool,
) -> list[DeviceLoaded]:
    """Reserve every buffer, read (and exchange) the bytes, then grant the leases; on any
    failure nothing stays reserved or leased on any device."""
    load = _Load(devs, [i for i, shard in enumerate(infos) if shard], plans)
    granted: list[Lease] = []
    try:
        load.reserve(ctx)
        storages = [ctx.storage(d) for d in devs[: len(opened)]]
        # One part of each shard per device for a split, else all of it.
        parts = {i: split(plans[0][i].nbytes, len(devs)) for i in load.shards}
        owners = _owners(plans, load.shards) if sharded and peer else {}
        started = time.perf_counter()
        reports = load.read(storages, opened, parts if how == "split" else {}, owners)
        if owners:  # each replicated tensor from the rank that read it to the others
            load.from_owners(owners)
        if how == "split":
            load.gather(parts)
        if how == "split" or owners:
            seconds = time.perf_counter() - started
            for (k, i), rep in reports.items():
                n = plans[k][i].nbytes
                reports[(k, i)] = dataclasses.replace(rep, nbytes=n, seconds=seconds)
        elif how == "host":  # from the first device to the others
            reports |= load.from_first()
        out = []
        for k, d in enumerate(devs):
            leases = []
            for i in load.shards:
                res = load.reserved.pop((k, i))
                lease = _grant(
                    ctx, res, plans[k][i], opened[0][i][1], reports[(k, i)], ttl_s, sharded=sharded
                )
                granted.append(lease)
                leases.append(lease)
            way: Delivery = "read" if how == "host" and k == 0 else how
            out.append(DeviceLoaded(d, ranks[k], loaded(ctx, d, leases), way))
        return out
    except BaseException:
        ctx.leases.release_many([lease.id for lease in granted])
        for res in load.reserved.values():
            res.cancel()
        raise


@dataclass
class _Load:
    """One multi-device load's buffers: per (device ``k``, shard ``i``), its reservation and
    a flat ``uint8`` view of it, taken once and handed to every io step."""

    devs: list[Device]
    shards: list[int]
    plans: list[list[_Plan]]
    reserved: dict[tuple[int, int], Reservation] = field(default_factory=dict)
    bufs: dict[tuple[int, int], Any] = field(default_factory=dict)

    def reserve(self, ctx: LoadContext) -> None:
        """Every budget first: a load over any device's budget reads nothing."""
        for k, d in enumerate(self.devs):
            for i in self.shards:
                n = max(1, self.plans[k][i].nbytes)
                res = self.reserved[(k, i)] = ctx.leases.reserve(d, alloc_size(d, n))
                res.attach(ctx.leases.pool.get(d, n))
                self.bufs[(k, i)] = flat(res, self.plans[k][i].nbytes)

    def read(
        self,
        storages: list[GpuDirectStorage],
        opened: list[list[tuple[GdsFile, int]]],
        parts: dict[int, list[tuple[int, int]]],
        owners: dict[tuple[int, int], int],
    ) -> dict[tuple[int, int], IoReport]:
        """Every reading device's pieces of every shard, all devices at once (each has its
        own host link)."""
        calls = [
            (
                s,
                opened[k][i][0],
                self.reserved[(k, i)],
                self.bufs[(k, i)],
                self.plans[k][i],
                parts[i][k] if parts else None,
                frozenset(j for (i2, j), o in owners.items() if i2 == i and o != k),
            )
            for k, s in enumerate(storages)
            for i in self.shards
        ]
        done = iter(storages[0].fan_out(_read_plan, calls))
        return {(k, i): next(done) for k in range(len(storages)) for i in self.shards}

    def from_owners(self, owners: dict[tuple[int, int], int]) -> None:
        """Each replicated tensor peer-copied from the rank that read it to the others."""
        plans = self.plans
        peer_copies(
            [
                PeerCopy(
                    self.devs[o],
                    self.bufs[(o, i)],
                    plans[o][i].pieces[j].at,
                    self.devs[k],
                    self.bufs[(k, i)],
                    plans[k][i].pieces[j].at,
                    plans[k][i].pieces[j].part.nbytes,
                )
                for (i, j), o in owners.items()
                for k in range(len(self.devs))
                if k != o
            ]
        )

    def gather(self, parts: dict[int, list[tuple[int, int]]]) -> None:
        """A split replica: each device's part of each shard copied to every other device."""
        for i in self.shards:
            all_gather([(d, self.bufs[(k, i)]) for k, d in enumerate(self.devs)], parts[i])

    def from_first(self) -> dict[tuple[int, int], IoReport]:
        """Replicas without peer access: the first device's bytes to the others through one
        pinned host staging buffer; their reports."""
        out = {}
        for i in self.shards:
            n = self.plans[0][i].nbytes
            targets = [(self.devs[k], self.bufs[(k, i)]) for k in range(1, len(self.devs))]
            reps = fan_out(self.bufs[(0, i)], self.devs[0], targets, n, "copy", "host")
            for k, rep in enumerate(reps, start=1):
                out[(k, i)] = rep
        return out


def _owners(plans: list[list[_Plan]], shards: list[int]) -> dict[tuple[int, int], int]:
    """Which rank reads each replicated tensor (``(shard, piece) → rank``) of a load of every
    rank: each is read from storage once, by the rank with the fewest such bytes so far, and
    peer-copied to the others, rather than read once per rank."""
    load = [0] * len(plans)
    owners = {}
    for i in shards:
        for j, p in enumerate(plans[0][i].pieces):
            if p.part.dim is None and p.part.nbytes:
                k = min(range(len(plans)), key=load.__getitem__)
                owners[(i, j)] = k
                load[k] += p.part.nbytes
    return owners


def _read_plan(
    storage: GpuDirectStorage,
    f: GdsFile,
    res: Reservation,
    buf: Any,
    plan: _Plan,
    window: tuple[int, int] | None,
    skip: frozenset[int],
) -> IoReport:
    """Read one shard's pieces into its reservation's buffer (only the buffer's bytes in
    ``window``, for a split replica; not the pieces in ``skip``, which another rank reads);
    see the module docstring."""
    with storage.device.current():
        return _read_pieces(storage, f, res, buf, plan, window, skip)


def _read_pieces(
    storage: GpuDirectStorage,
    f: GdsFile,
    res: Reservation,
    buf: Any,
    plan: _Plan,
    window: tuple[int, int] | None,
    skip: frozenset[int],
) -> IoReport:
    reads: list[tuple[int, int, int]] = []
    cuts: list[_Piece] = []
    for j, p in enumerate(plan.pieces):
        if p.part.nbytes == 0 or j in skip:
            continue
        if p.part.dim in (None, 0) or p.part.segment_bytes >= STRIDED_MIN_SEGMENT:
            at = p.at
            for off, n in p.part.byte_ranges(p.info.begin):
                reads.append((off, n, at))
                at += n
        else:
            cuts.append(p)
    if window is not None:  # replicas only: no slices, so no cuts
        reads = _clip(reads, *window)
    parts: list[IoReport] = []
    with f.guard() as fd:
        if reads:
            parts.append(storage.transfer_ranges(f, fd, buf, reads))
        for p in cuts:
            off, n = p.part.whole_range(p.info.begin)
            whole = storage.device.empty(n)
            parts.append(storage.transfer_ranges(f, fd, whole, [(off, n, 0)]))
            view = p.part.cut_whole(whole)
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


def _clip(reads: list[tuple[int, int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The parts of ``(file_offset, nbytes, dst_offset)`` reads landing in ``[lo, hi)`` of the
    buffer."""
    out = []
    for off, n, at in reads:
        a, b = max(at, lo), min(at + n, hi)
        if b > a:
            out.append((off + a - at, b - a, a))
    return out


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
    n = plan.nbytes
    spec = LeaseSpec(n, "uint8", (n,), "safetensors", (file_id,), report, ttl_s, tensors=layout)
    return ctx.leases.grant(res, spec)
