"""Safetensors loads: the tensors of one or more shards into one lease per shard.

The data path (:mod:`tiering.io`) parses the headers and lays the selected tensors out; this
module reserves the budget of each shard's buffer as the data path asks for it, and turns the
shards into leases with a name → location map.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tiering.errors import InvalidInput, TooLarge
from tiering.io import Device, GdsFile
from tiering.io.buffers import alloc_size
from tiering.serving.config import FileRef
from tiering.serving.context import LoadContext
from tiering.serving.leases import Lease, Reservation

__all__ = ["Select", "TensorLoc", "TensorsLoaded", "load_shards"]

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


@dataclass(frozen=True)
class TensorsLoaded:
    leases: list[Lease]
    tensors: dict[str, TensorLoc]


def load_shards(
    ctx: LoadContext,
    files: Sequence[FileRef],
    *,
    names: Sequence[str] | None,
    device: str | Device,
    ttl_s: float | None,
    select: Select | None = None,
) -> TensorsLoaded:
    """Tensors of safetensors shards; see :meth:`tiering.serving.Loader.load_safetensors`.

    ``select`` (with ``names`` None) chooses the tensors once the shards are open, so a
    caller can check them (a model's weight map) without opening them twice.
    """
    if not files:
        raise InvalidInput("name at least one file")
    if len(files) > ctx.config.max_batch_items:
        raise TooLarge(
            f"{len(files)} files is over the limit of {ctx.config.max_batch_items}",
            limit=ctx.config.max_batch_items,
        )
    dev = ctx.device(device)
    ctx.leases.ttl(ttl_s)
    storage = ctx.storage(dev)
    lock = threading.Lock()
    reserved: list[Reservation] = []
    by_array: dict[int, Reservation] = {}

    def alloc(nbytes: int) -> Any:
        res = ctx.leases.reserve(dev, alloc_size(dev, nbytes))
        with lock:
            reserved.append(res)
        buf = res.attach(ctx.leases.pool.get(dev, nbytes))
        arr = buf.array()[:nbytes]
        with lock:
            by_array[id(arr)] = res
        return arr

    leases: list[Lease] = []
    tensors: dict[str, TensorLoc] = {}
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(ctx.open(ref, storage)) for ref in files]
        if select is not None:
            names = select([f for f, _ in opened])
        try:
            storage.device.make_current()
            shards = storage.load_safetensors_raw([f for f, _ in opened], names, alloc)
            for shard, (_f, file_id) in zip(shards, opened, strict=True):
                res = by_array[id(shard.buffer)]
                if not shard.tensors:
                    res.cancel()  # nothing selected from this shard
                    continue
                assert res.buffer is not None
                res.buffer.synchronize()
                layout = {
                    name: {
                        "offset": at,
                        "dtype": t.dtype,
                        "shape": list(t.shape),
                        "nbytes": t.nbytes,
                    }
                    for name, (at, t) in shard.tensors.items()
                }
                n = int(shard.buffer.nbytes)
                lease = ctx.leases.grant(
                    res,
                    nbytes=n,
                    dtype="uint8",
                    shape=(n,),
                    kind="safetensors",
                    file_ids=(file_id,),
                    report=shard.report,
                    ttl_s=ttl_s,
                    tensors=layout,
                )
                leases.append(lease)
                for name, (at, t) in shard.tensors.items():
                    tensors[name] = TensorLoc(lease.id, at, t.dtype, t.shape, t.nbytes)
        except BaseException:
            ctx.leases.release_many([lease.id for lease in leases])
            for res in reserved:
                res.cancel()
            raise
    for lease in leases:
        assert lease.report is not None
        ctx.observe("safetensors", dev, lease.report)
    return TensorsLoaded(leases, tensors)
