"""Replicas: bytes already on one GPU copied to several others, read from storage only once.

Two ways, chosen per host: a peer copy (``cudaMemcpyPeerAsync``, direct over NVLink or PCIe
P2P) to every target when every target can access the source's memory (on a 2×H200 host:
396 GB/s against 55.5 GB/s per host link), else one device → host copy into pinned staging
and concurrent host → device copies from that one staging buffer, one per target's own link.
Each target copies on its own non-blocking stream, so the copies run at once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

from ._copies import _D2H, _H2D, _stream, peer_access
from ._device import Device, import_cupy
from ._stats import IoReport, LoadSource

__all__ = ["Delivery", "fan_out", "peer_ok"]

Delivery = Literal["read", "peer", "host"]
"""How a device got its bytes: ``read`` from storage (or a held copy), ``peer`` copy from
the first device, ``host``: device → pinned host → device."""


def peer_ok(src: Device, targets: Sequence[Device]) -> bool:
    """Whether every target can read ``src``'s memory directly (turns the access on)."""
    return all(peer_access(t.index, src.index) for t in targets)


def fan_out(
    src: Any, src_device: Device, targets: Sequence[tuple[Device, Any]], nbytes: int, tier: str
) -> tuple[Delivery, list[IoReport]]:
    """Copy ``nbytes`` of flat uint8 ``src`` on ``src_device`` into each target's flat uint8
    array; returns how, and one report per target (source ``peer`` or ``gpu``: the bytes came
    from GPU memory, not storage). Returns when every copy has landed."""
    if not targets:
        return "read", []
    cp = import_cupy()
    devices = [d for d, _ in targets]
    how: Delivery = "peer" if peer_ok(src_device, devices) else "host"
    started = time.perf_counter()
    streams = []
    if how == "peer":
        for dev, dst in targets:
            with cp.cuda.Device(dev.index):
                s = _stream(dev.index)
                cp.cuda.runtime.memcpyPeerAsync(
                    dst.data.ptr, dev.index, src.data.ptr, src_device.index, nbytes, s.ptr
                )
                streams.append(s)
    else:
        staging = cp.cuda.alloc_pinned_memory(max(1, nbytes))
        with cp.cuda.Device(src_device.index):
            s = _stream(src_device.index)
            cp.cuda.runtime.memcpyAsync(staging.ptr, src.data.ptr, nbytes, _D2H, s.ptr)
            s.synchronize()
        for dev, dst in targets:
            with cp.cuda.Device(dev.index):
                s = _stream(dev.index)
                cp.cuda.runtime.memcpyAsync(dst.data.ptr, staging.ptr, nbytes, _H2D, s.ptr)
                streams.append(s)
    for s in streams:
        s.synchronize()
    seconds = time.perf_counter() - started
    source: LoadSource = "peer" if how == "peer" else "gpu"
    return how, [IoReport(nbytes, "copy", tier, seconds, source=source) for _ in targets]
