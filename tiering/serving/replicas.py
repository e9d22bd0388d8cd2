"""Replicated loads and gathers: one read of storage, the same bytes on several GPUs.

The first device is filled by the ordinary single-device load (so it gets everything that
path does: held copies, residency, the I/O path of its tier); the others get its bytes by
peer copy, or through one pinned host staging buffer where peer access is off (see
:mod:`tiering.io._fanout`). Every other device's budget is reserved before the first device
reads, so an overrun anywhere reads nothing and leaves nothing leased.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiering.io import Device
from tiering.io._fanout import Delivery, fan_out
from tiering.io.buffers import alloc_size
from tiering.serving.context import LoadContext
from tiering.serving.devices import parse_devices
from tiering.serving.leases import Lease, Reservation

__all__ = ["Replica", "replicate"]


@dataclass(frozen=True)
class Replica:
    """One device's lease of a replicated load, and how its bytes came."""

    lease: Lease
    delivery: Delivery


def replicate(
    ctx: LoadContext,
    devices: str | Sequence[str | Device],
    *,
    nbytes: Callable[[], int],
    first: Callable[[Device], Lease],
    ttl_s: float | None,
    op: str,
) -> list[Replica]:
    """``first(device)`` on the first device, its bytes copied to the others.

    ``nbytes()`` is the load's size, asked before anything is read, to reserve the other
    devices; a first lease of another size (the file changed) re-reserves them.
    """
    devs = parse_devices(ctx, devices)
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
        targets = []
        for d, res in zip(devs[1:], others, strict=True):
            assert res.buffer is not None
            targets.append((d, res.buffer.array()[:n]))
        tier = lease0.report.tier if lease0.report is not None else "copy"
        how, reports = fan_out(src, devs[0], targets, n, tier)
        out = [Replica(lease0, "read")]
        for res, report in zip(others, reports, strict=True):
            # On an error below, cancel() skips what was granted (see Reservation).
            lease = ctx.leases.grant(
                res,
                nbytes=n,
                dtype=lease0.dtype,
                shape=lease0.shape,
                kind=lease0.kind,
                file_ids=lease0.file_ids,
                report=report,
                ttl_s=ttl_s,
            )
            granted.append(lease)
            out.append(Replica(lease, how))
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
