"""Safetensors loads: the tensors of one or more shards into one lease per shard.

The data path (:mod:`tiering.io`) parses the headers and lays the selected tensors out; this
module reserves the budget of each shard's buffer as the data path asks for it, and turns the
shards into leases with a name → location map.

A ``shared`` load is read-only: a shard whose selected tensors are resident on the device
(the same selection of the same file at the same generation, see
:mod:`tiering.serving.residency`) is handed out again, allocation and layout as they are; the
other shards are read into read-only buffers that become resident.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiering.errors import InvalidInput, TooLarge
from tiering.io import Device, GdsFile, GpuDirectStorage, IoReport, ShardLayout
from tiering.io.buffers import alloc_size
from tiering.io.fences import Fence
from tiering.io.safetensors import parse_header, select_tensors
from tiering.serving.config import FileRef
from tiering.serving.context import LoadContext
from tiering.serving.leases import Lease, LeaseSpec, Reservation
from tiering.serving.loads import record_of
from tiering.serving.residency import ResidentKey, authoritative_stat

__all__ = ["Select", "TensorLoc", "TensorsLoaded", "load_shards", "loaded"]

Select = Callable[[Sequence[GdsFile]], Sequence[str] | None]
"""``select(shards)``: check the opened shards (in request order) before anything is
reserved, and return the tensors to load (None: all)."""


@dataclass(frozen=True)
class TensorLoc:
    """Where one safetensors tensor lies: a lease and a byte offset inside it."""

    buffer_id: str
    offset: int
    dtype: str  # the safetensors name: F32, BF16, ...
    shape: tuple[int, ...]
    nbytes: int
    #: Of a sharded load (see :mod:`tiering.serving.sharded`): the whole tensor's shape and
    #: where this slice starts in it (its index along every dimension); None otherwise.
    full_shape: tuple[int, ...] | None = None
    slice_offset: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TensorsLoaded:
    leases: list[Lease]
    tensors: dict[str, TensorLoc]
    #: Seconds of each phase of a plain load (:func:`load_shards`), for the REST reply's
    #: ``Server-Timing`` header: ``open`` (the files), ``read`` (headers, allocations and
    #: reads, shards concurrently), ``alloc`` (the allocations, summed over the shards: part
    #: of ``read``), ``sync`` (waiting for the device's copies) and ``grant`` (the leases and
    #: their export handles). Empty for the other loads.
    timings: dict[str, float] = field(default_factory=dict)


def load_shards(
    ctx: LoadContext,
    files: Sequence[FileRef],
    *,
    names: Sequence[str] | None,
    device: str | Device,
    ttl_s: float | None,
    select: Select | None = None,
    shared: bool = False,
    wait: bool = True,
) -> TensorsLoaded:
    """Tensors of safetensors shards; see :meth:`tiering.serving.Loader.load_safetensors`.

    ``select`` (with ``names`` None) chooses the tensors once the shards are open, so a
    caller can check them (a model's weight map) without opening them twice. ``wait`` false
    (a GPU, not ``shared``): the copies of bytes held in memory are left to a
    :class:`~tiering.io.fences.Fence` that the buffers' handles name, and counted (stats,
    the load observer) once they land.
    """
    check_batch(ctx, files)
    dev = ctx.device(device)
    ctx.leases.ttl(ttl_s)
    storage = ctx.storage(dev)
    if shared:
        return _load_shared(ctx, storage, files, names, select, ttl_s)
    alloc = _Allocator(ctx, dev)
    timings = alloc.timings
    leases: list[Lease] = []
    fence = None if wait or not dev.is_cuda else Fence(dev)
    with contextlib.ExitStack() as stack:
        t0 = time.perf_counter()
        opened = [stack.enter_context(ctx.open(ref, storage)) for ref in files]
        if select is not None:
            names = select([f for f, _ in opened])
        t1 = time.perf_counter()
        timings["open"] = t1 - t0
        try:
            try:
                with storage.device.current():
                    shards = storage.load_safetensors_raw(
                        [f for f, _ in opened], names, alloc, fence, ctx.reads.on(storage)
                    )
            finally:
                if fence is not None:
                    fence.seal()  # even after a failure: what was queued is waited for
            timings["read"] = time.perf_counter() - t1
            for shard, (_f, file_id) in zip(shards, opened, strict=True):
                res = alloc.by_array[id(shard.buffer)]
                if not shard.tensors:
                    res.cancel()  # nothing selected from this shard
                    continue
                leases.append(_grant(ctx, res, shard, file_id, ttl_s, fence=fence, timings=timings))
        except BaseException:
            if fence is not None:
                fence.wait()  # nothing may still be copying into buffers given back
            ctx.leases.release_many([lease.id for lease in leases])
            for res in alloc.reserved:
                res.cancel()
            raise
    out = loaded(ctx, dev, leases, fence)
    out.timings.update(timings)
    return out


def check_batch(ctx: LoadContext, files: Sequence[FileRef]) -> None:
    """A load names at least one file and at most ``max_batch_items``."""
    if not files:
        raise InvalidInput("name at least one file")
    if len(files) > ctx.config.max_batch_items:
        raise TooLarge(
            f"{len(files)} files is over the limit of {ctx.config.max_batch_items}",
            limit=ctx.config.max_batch_items,
        )


class _Allocator:
    """The shard buffers of one load on ``dev``, reserved against its budget as the reader
    asks for them (from its threads), with the phases' times for the reply's Server-Timing."""

    def __init__(self, ctx: LoadContext, dev: Device) -> None:
        self.ctx, self.dev = ctx, dev
        self.lock = threading.Lock()
        self.reserved: list[Reservation] = []
        self.by_array: dict[int, Reservation] = {}
        # A few clock reads per shard: the phases of the load.
        self.timings = dict.fromkeys(("open", "read", "alloc", "sync", "grant"), 0.0)

    def __call__(self, nbytes: int) -> Any:
        t0 = time.perf_counter()
        leases = self.ctx.leases
        res = leases.reserve(self.dev, alloc_size(self.dev, nbytes))
        with self.lock:
            self.reserved.append(res)
        buf = res.attach(leases.pool.get(self.dev, nbytes))
        arr = buf.array()[:nbytes]
        with self.lock:
            self.by_array[id(arr)] = res
            self.timings["alloc"] += time.perf_counter() - t0
        return arr


def _grant(
    ctx: LoadContext,
    res: Reservation,
    shard: ShardLayout,
    file_id: int,
    ttl_s: float | None,
    *,
    read_only: bool = False,
    fence: Fence | None = None,
    timings: dict[str, float] | None = None,
) -> Lease:
    """One shard's reservation, filled, as a lease with its tensors' layout (``timings``:
    where the seconds of its ``sync`` and ``grant`` are added). With a pending ``fence`` the
    buffer is handed out before its copies land, and its handle names the fence."""
    assert res.buffer is not None
    t0 = time.perf_counter()
    if fence is not None and fence.pending:
        res.buffer.fence = fence
    else:
        res.buffer.synchronize()
    t1 = time.perf_counter()
    layout = {
        name: {"offset": at, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes}
        for name, (at, t) in shard.tensors.items()
    }
    n = int(shard.buffer.nbytes)
    spec = LeaseSpec(
        n, "uint8", (n,), "safetensors", (file_id,), shard.report, ttl_s, tensors=layout
    )
    lease = ctx.leases.grant(res, spec, read_only=read_only)
    if timings is not None:
        timings["sync"] += t1 - t0
        timings["grant"] += time.perf_counter() - t1
    return lease


def loaded(
    ctx: LoadContext, dev: Device, leases: list[Lease], fence: Fence | None = None
) -> TensorsLoaded:
    """The reply of a load: every lease's tensors by name; each lease reported (once its
    copies have landed, where ``fence`` still waits for them: with the seconds they took)."""
    tensors: dict[str, TensorLoc] = {}
    for lease in leases:
        for name, t in lease.tensors.items():
            full, at = t.get("full_shape"), t.get("slice_offset")
            tensors[name] = TensorLoc(
                lease.id,
                int(t["offset"]),
                t["dtype"],
                tuple(t["shape"]),
                int(t["nbytes"]),
                None if full is None else tuple(full),
                None if at is None else tuple(at),
            )
        assert lease.report is not None
        if fence is not None and fence.pending:
            fence.then(_observe_landed(ctx, dev, lease.report))
        else:
            ctx.observe("safetensors", dev, lease.report)
    return TensorsLoaded(leases, tensors)


def _observe_landed(ctx: LoadContext, dev: Device, report: IoReport) -> Callable[[Fence], None]:
    def observe(fence: Fence) -> None:
        seconds = max(report.seconds, fence.seconds or 0.0)
        landed = dataclasses.replace(report, seconds=seconds, landed=True)
        ctx.observe("safetensors", dev, landed)

    return observe


def _load_shared(
    ctx: LoadContext,
    storage: GpuDirectStorage,
    files: Sequence[FileRef],
    names: Sequence[str] | None,
    select: Select | None,
    ttl_s: float | None,
) -> TensorsLoaded:
    """A shared load: resident shards handed out again, the others read and made resident."""
    dev = storage.device
    residency = ctx.residency
    recs = [record_of(ctx, ref) for ref in files]
    tiers = [ctx.engine.tiers.get(r.tier) for r in recs]
    # Before anything is opened or read: a change after it shows (see authoritative_stat).
    stats = [authoritative_stat(r, t) for r, t in zip(recs, tiers, strict=True)]
    leases: dict[int, Lease] = {}
    alloc = _Allocator(ctx, dev)
    try:
        with contextlib.ExitStack() as stack:
            opened = [stack.enter_context(ctx.open(r.id, storage)) for r in recs]
            if select is not None:
                names = select([f for f, _ in opened])
            headers = []
            for f, _id in opened:
                with f.guard():
                    headers.append(parse_header(f.path, f.size(), f.read_bytes))
            chosen = select_tensors(headers, names)
            keys = {
                i: ResidentKey.tensors(recs[i], dev, sel) for i, sel in enumerate(chosen) if sel
            }
            stack.enter_context(residency.claim(keys.values()))
            for i, key in keys.items():
                wanted_here = [headers[i].tensors[n] for n in chosen[i]]
                found = residency.find_tensors(key, recs[i], tiers[i], wanted_here)
                if found is not None:
                    entry, layout = found
                    hit = residency.grant_shared(
                        entry, recs[i], kind="safetensors", ttl_s=ttl_s, tensors=layout
                    )
                    if hit is not None:
                        leases[i] = hit
            todo = [i for i in keys if i not in leases]
            if todo:
                wanted = None if names is None else [n for i in todo for n in chosen[i]]
                with storage.device.current():
                    todo_files = [opened[i][0] for i in todo]
                    shards = storage.load_safetensors_raw(
                        todo_files, wanted, alloc, transfer=ctx.reads.on(storage)
                    )
                for i, shard in zip(todo, shards, strict=True):
                    res = alloc.by_array[id(shard.buffer)]
                    lease = _grant(ctx, res, shard, recs[i].id, ttl_s, read_only=True)
                    leases[i] = lease
                    stat = stats[i]
                    if stat is not None:
                        base, head = _span(shard, opened[i][0])
                        residency.register(keys[i], lease, stat, base=base, head=head)
    except BaseException:
        ctx.leases.release_many([lease.id for lease in leases.values()])
        for res in alloc.reserved:
            res.cancel()
        raise
    return loaded(ctx, dev, [leases[i] for i in sorted(leases)])


def _span(shard: ShardLayout, f: GdsFile) -> tuple[int | None, bytes | None]:
    """Where a shard's buffer lies in its file, when it is one run of the file's bytes (its
    tensors read in one span), and the file's bytes before it where it runs to the end (the
    header, a few KiB): what lets the copy serve any other load of the file."""
    if not shard.tensors:
        return None, None
    base = min(t.begin for _at, t in shard.tensors.values())
    if any(at != t.begin - base for at, t in shard.tensors.values()):
        return None, None  # a selection packed apart: only the same selection finds it
    if base + int(shard.buffer.nbytes) != f.size():
        return base, None
    with f.guard():
        return base, f.read_bytes(base, 0)
