"""Replicas: the same bytes on several GPUs, read from storage only once.

Two ways, chosen per host by measuring (:func:`choose`):

- **peer** (``cudaMemcpyPeerAsync``, direct over NVLink or PCIe P2P): the load is *split*.
  Each device reads its own 1/N of the bytes from storage, over its own host link and all at
  once, then the devices exchange their parts GPU to GPU (:func:`all_gather`). Storage and
  the page cache are still read once in all, but N links carry the bytes instead of one, so
  a replicated load can take less time than a load into one GPU. On the 2×H200 host a peer
  copy runs at 396 GB/s against 55.5 GB/s per host link.
- **host**, where some pair has no peer access or the peer copy measured slower: one device
  reads everything, one device → host copy fills pinned staging, and concurrent host →
  device copies from that one staging buffer feed the others, one per target's own link
  (:func:`fan_out`).

Each target copies on its own non-blocking stream, so the copies run at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

from ._copies import _D2H, _H2D, _stream, peer_access
from ._device import Device, import_cupy
from ._stats import IoReport, LoadSource

__all__ = [
    "Delivery",
    "DeliveryMode",
    "PeerCopy",
    "all_gather",
    "choose",
    "fan_out",
    "measured",
    "peer_copies",
    "peer_ok",
    "split",
]

log = logging.getLogger(__name__)

Delivery = Literal["read", "peer", "host", "split"]
"""How a device got its bytes: ``read`` from storage (or a held copy), ``peer`` copy from
the first device, ``host``: device → pinned host → device, ``split``: 1/N read from storage,
the rest by peer copy from the other devices of the load."""

DeliveryMode = Literal["auto", "peer", "host"]
"""The setting: ``auto`` measures once per pair of GPUs and takes the faster way; ``peer``
takes peer copies wherever peer access exists; ``host`` always stages through host memory."""

#: Bytes of the one-off copies that compare the two ways (per pair of GPUs, per process).
PROBE_BYTES = 64 << 20
#: Inner boundaries of a split fall on multiples of this: whole pages for direct I/O, and
#: parts large enough that each device's read is a few long requests.
SPLIT_ALIGN = 2 << 20

_measured: dict[tuple[int, int], tuple[float, float]] = {}
_measure_lock = threading.Lock()


def peer_ok(src: Device, targets: Sequence[Device]) -> bool:
    """Whether every target can read ``src``'s memory directly (turns the access on)."""
    return all(peer_access(t.index, src.index) for t in targets)


def choose(devices: Sequence[Device], mode: DeliveryMode = "auto") -> Literal["peer", "host"]:
    """How replicas over ``devices`` (GPUs) exchange bytes: ``peer`` needs access between
    every pair (a split load copies every way); ``auto`` also needs peer copies to have
    measured faster than staging through the host for every pair."""
    if mode == "host":
        return "host"
    for a in devices:
        for b in devices:
            if a != b and not peer_access(b.index, a.index):
                return "host"
    if mode == "peer":
        return "peer"
    for a in devices:
        for b in devices:
            if a != b:
                peer_gbps, host_gbps = _measure(a, b)
                if peer_gbps <= host_gbps:
                    return "host"
    return "peer"


def measured() -> dict[str, dict[str, float]]:
    """The probes taken so far: ``"cuda:0->cuda:1" → {"peer_gbps", "host_gbps"}``."""
    with _measure_lock:
        return {
            f"cuda:{a}->cuda:{b}": {"peer_gbps": p, "host_gbps": h}
            for (a, b), (p, h) in sorted(_measured.items())
        }


def _measure(src: Device, dst: Device) -> tuple[float, float]:
    """GB/s of a peer copy and of the host way from ``src`` to ``dst``: best of 3 copies of
    :data:`PROBE_BYTES` each, once per pair and process (a few milliseconds)."""
    key = (src.index, dst.index)
    with _measure_lock:
        found = _measured.get(key)
        if found is not None:
            return found
        cp = import_cupy()
        n = PROBE_BYTES
        with cp.cuda.Device(src.index):
            a = cp.empty(n, dtype=cp.uint8)
        with cp.cuda.Device(dst.index):
            b = cp.empty(n, dtype=cp.uint8)
        staging = cp.cuda.alloc_pinned_memory(n)
        s_src, s_dst = _stream(src.index), _stream(dst.index)

        def peer() -> None:
            cp.cuda.runtime.memcpyPeerAsync(
                b.data.ptr, dst.index, a.data.ptr, src.index, n, s_dst.ptr
            )
            s_dst.synchronize()

        def host() -> None:
            cp.cuda.runtime.memcpyAsync(staging.ptr, a.data.ptr, n, _D2H, s_src.ptr)
            s_src.synchronize()
            cp.cuda.runtime.memcpyAsync(b.data.ptr, staging.ptr, n, _H2D, s_dst.ptr)
            s_dst.synchronize()

        rates = []
        for way in (peer, host):
            way()  # warm: the first copy of a pair sets up its mappings
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                way()
                best = min(best, time.perf_counter() - t0)
            rates.append(n / best / 1e9)
        found = _measured[key] = (rates[0], rates[1])
        log.info(
            "tiering.io: %s -> %s: peer copy %.1f GB/s, through host %.1f GB/s",
            src,
            dst,
            found[0],
            found[1],
        )
        return found


def split(nbytes: int, parts: int, align: int = SPLIT_ALIGN) -> list[tuple[int, int]]:
    """``[0, nbytes)`` as ``parts`` consecutive ``(lo, hi)`` ranges of about equal size,
    inner bounds on multiples of ``align``; trailing ranges may be empty."""
    step = -(-max(0, nbytes) // max(1, parts))
    step = max(align, -(-step // align) * align)
    return [(min(nbytes, k * step), min(nbytes, (k + 1) * step)) for k in range(parts)]


def all_gather(arrays: Sequence[tuple[Device, Any]], parts: Sequence[tuple[int, int]]) -> float:
    """Each device ``k`` of ``arrays`` holds the right bytes at ``parts[k]`` of its flat uint8
    array; copy every part into every other device's array, at the same offsets, by peer
    copies (peer access must be on: see :func:`choose`). Returns the seconds taken, once
    every copy has landed."""
    copies = [
        PeerCopy(src_dev, src, lo, dev, dst, lo, hi - lo)
        for k, (dev, dst) in enumerate(arrays)
        for j, ((src_dev, src), (lo, hi)) in enumerate(zip(arrays, parts, strict=True))
        if j != k and hi > lo
    ]
    return peer_copies(copies)


class PeerCopy(NamedTuple):
    """``nbytes`` from flat uint8 ``src[src_at:]`` on ``src_dev`` to ``dst[dst_at:]`` on
    ``dst_dev``."""

    src_dev: Device
    src: Any
    src_at: int
    dst_dev: Device
    dst: Any
    dst_at: int
    nbytes: int


def peer_copies(copies: Sequence[PeerCopy]) -> float:
    """Run every copy at once, each on its target's copy stream (peer access must be on);
    returns the seconds until the last has landed."""
    cp = import_cupy()
    started = time.perf_counter()
    streams: dict[int, Any] = {}
    for c in copies:
        s = streams.get(c.dst_dev.index)
        if s is None:
            s = streams[c.dst_dev.index] = _stream(c.dst_dev.index)
        with cp.cuda.Device(c.dst_dev.index):
            cp.cuda.runtime.memcpyPeerAsync(
                c.dst.data.ptr + c.dst_at,
                c.dst_dev.index,
                c.src.data.ptr + c.src_at,
                c.src_dev.index,
                c.nbytes,
                s.ptr,
            )
    for s in streams.values():
        s.synchronize()
    return time.perf_counter() - started


def fan_out(
    src: Any,
    src_device: Device,
    targets: Sequence[tuple[Device, Any]],
    nbytes: int,
    tier: str,
    how: Literal["peer", "host"],
) -> list[IoReport]:
    """Copy ``nbytes`` of flat uint8 ``src`` on ``src_device`` into each target's flat uint8
    array, ``how`` (:func:`choose`); one report per target (source ``peer`` or ``gpu``: the
    bytes came from GPU memory, not storage). Returns when every copy has landed."""
    if not targets:
        return []
    cp = import_cupy()
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
    return [IoReport(nbytes, "copy", tier, seconds, source=source) for _ in targets]
