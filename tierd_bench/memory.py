"""``tierd bench memory``: loads served from copies already in memory, against the storage path.

Issue 11's measure. One file of ``size`` bytes on the fastest storage tier, hot in the page
cache; one in-process :class:`~tiering.serving.Loader` over an engine whose memory tier holds
twice that. Each row is a median of ``repeats`` after a warm-up, with its CPU cost (process
CPU-seconds per GB, every thread counted), and every load's bytes and ``source`` are checked:

- **ceiling**: one pinned host → device copy of ``size`` bytes (``cudaMemcpyAsync``), or one
  host memcpy for ``cpu``;
- **page cache**: ``Loader.load`` of the file with no copy anywhere (source ``page_cache``);
- **memory tier**: the same load once ``prefetch(target="memory")`` has staged the file into
  pinned host memory (source ``memory``): against the ceiling, and its CPU cost against the
  page-cache path's;
- **resident on the same GPU**: the same load while a ``shared=True`` lease of the file is
  live on the device (source ``gpu``: one device → device copy);
- **resident on another GPU** (hosts with two): the copy is on ``cuda:1`` (source ``peer``);
- **shared**: a second ``shared=True`` load of a resident file: the time to the lease, and the
  device bytes it added (zero: it is the same allocation).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tiering.checksum import Hasher
from tiering.config import EngineConfig, TierConfig
from tiering.engine import Engine

from ._measure import GiB, MiB, default_device, format_size, free_gpu, gbps, gpu_name
from ._report import BenchRow, Report, describe_device

__all__ = ["run"]

NAME = "bench/memory.bin"


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _digest(array: Any) -> str:
    host = array.get() if hasattr(array, "get") else np.asarray(array)
    h = Hasher()
    h.update(np.ascontiguousarray(host).view(np.uint8).tobytes())
    return h.value()


class _Run:
    def __init__(self, report: Report, size: int, repeats: int, say: Callable[[str], None]):
        self.report = report
        self.size = size
        self.repeats = repeats
        self.say = say

    def timed(self, fn: Callable[[], Any], sync: Callable[[], None]) -> tuple[float, float]:
        """Median seconds and CPU-seconds of ``fn`` over ``repeats`` after one warm-up."""
        times: list[float] = []
        cpus: list[float] = []
        for i in range(self.repeats + 1):
            sync()
            c0, t0 = _cpu(), time.perf_counter()
            fn()
            sync()
            t, c = time.perf_counter() - t0, _cpu() - c0
            if i:
                times.append(t)
                cpus.append(c)
        return statistics.median(times), statistics.median(cpus)

    def rate(self, key: str, label: str, t: float, cpu: float, **kw: Any) -> BenchRow:
        row = BenchRow(key, label, gbps(self.size, t), "GB/s", **kw)
        self.report.add(row)
        self.report.add(
            BenchRow(f"{key}_cpu", f"  CPU cost of {label}", cpu / (self.size / 1e9), "CPU-s/GB")
        )
        return row


def _ceiling(run: _Run, device: str) -> tuple[float, float]:
    """Seconds and CPU-seconds of one pinned host → device copy (or one host memcpy for
    ``cpu``)."""
    if device == "cpu":
        src = np.ones(run.size, dtype=np.uint8)
        dst = np.empty_like(src)
        return run.timed(lambda: np.copyto(dst, src), lambda: None)
    import cupy as cp

    index = int(device.split(":")[1])
    pinned = cp.cuda.PinnedMemory(run.size)
    host = np.frombuffer(cp.cuda.PinnedMemoryPointer(pinned, 0), dtype=np.uint8, count=run.size)
    host[:] = 1
    with cp.cuda.Device(index):
        dst = cp.empty(run.size, dtype=cp.uint8)
        stream = cp.cuda.Stream(non_blocking=True)

        def copy() -> None:
            cp.cuda.runtime.memcpyAsync(dst.data.ptr, host.ctypes.data, run.size, 1, stream.ptr)
            stream.synchronize()

        return run.timed(copy, lambda: None)


def run(
    size: int = 4 << 30,
    device: str = "auto",
    *,
    repeats: int = 5,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Measure loads from the memory tier and from GPU-resident copies against the page cache."""
    from tiering.serving import Loader, LoaderConfig

    if size < MiB or repeats < 1:
        raise ValueError("size must be at least 1 MiB and repeats at least 1")
    device = default_device() if device == "auto" else device
    gpus = _gpu_count() if device != "cpu" else 0
    setup: dict[str, Any] = {"device": device, "gpu": gpu_name(device), "size_bytes": size}
    setup |= {"repeats": repeats, "gpus": gpus}
    report = Report(
        "memory",
        f"tierd bench memory: {format_size(size)}, {describe_device(setup)}, medians of {repeats}",
        setup,
    )
    r = _Run(report, size, repeats, say)
    sync = _syncer(device)
    with tempfile.TemporaryDirectory(prefix="tierd-bench-") as tmp:
        root = Path(tmp)
        path = root / "nvme" / NAME
        path.parent.mkdir(parents=True)
        say(f"writing {format_size(size)} under {root / 'nvme'}")
        data = np.random.default_rng(11).integers(0, 256, size, dtype=np.uint8)
        data.tofile(path)
        expected = _digest(data)
        del data
        tiers = (
            TierConfig("ram", kind="memory", quota_bytes=2 * size + GiB),
            TierConfig("nvme", root / "nvme"),
            TierConfig("ssd", root / "ssd"),
        )
        config = EngineConfig(
            tiers=tiers, catalog_url=f"sqlite:///{root / 'catalog.db'}", watch=False
        )
        # No scheduler: the policy must not stage the file into memory by its heat mid-run.
        eng = Engine(config).start(scheduler=False)
        try:
            fid = eng.lookup(NAME).id
            budget = 4 * size + GiB
            # Each resident row's copy is held by a live lease, and goes with it: a copy kept
            # on cuda:0 would serve the peer row (kept copies are `tierd bench restart`'s).
            cfg = LoaderConfig(
                cpu_budget_bytes=budget, gpu_budget_bytes=budget, gpu_resident_bytes=0
            )
            loader = Loader(eng, cfg).start()
            try:
                _measure(r, loader, fid, device, gpus, expected, sync)
            finally:
                loader.stop()
                free_gpu()
        finally:
            eng.stop()
    return report


def _measure(
    r: _Run,
    loader: Any,
    fid: int,
    device: str,
    gpus: int,
    expected: str,
    sync: Callable[[], None],
) -> None:
    def load(source: str, dev: str = device, shared: bool = False) -> Callable[[], None]:
        def fn() -> None:
            lease = loader.load(fid, device=dev, shared=shared)
            try:
                got = lease.report.source
                if got != source:
                    raise RuntimeError(f"expected a load from {source}, got one from {got}")
            finally:
                loader.leases.release(lease.id)

        return fn

    def check(dev: str = device) -> None:
        lease = loader.load(fid, device=dev)
        try:
            digest = _digest(lease.buffer.array()[: r.size])
        finally:
            loader.leases.release(lease.id)
        if digest != expected:
            raise RuntimeError(f"a load into {dev} returned wrong bytes")

    r.say("ceiling")
    t_ceiling, cpu_ceiling = _ceiling(r, device)
    ceiling = "pinned host -> device copy" if device != "cpu" else "host memcpy"
    r.rate("ceiling", ceiling, t_ceiling, cpu_ceiling)

    r.say("page cache path")
    check()
    t_pc, cpu_pc = r.timed(load("page_cache"), sync)
    r.rate("page_cache", f"Loader.load -> {device}, page cache", t_pc, cpu_pc)
    r.report.add(_ratio_row(r, "page_cache_vs_ceiling", t_ceiling, t_pc, ">= 0.9x"))

    r.say("memory tier")
    _prefetch_memory(loader, fid)
    check()
    t_mem, cpu_mem = r.timed(load("memory"), sync)
    r.rate("memory", f"Loader.load -> {device}, memory tier", t_mem, cpu_mem)
    r.report.add(_ratio_row(r, "memory_vs_ceiling", t_ceiling, t_mem, ">= 0.95x"))
    r.report.add(_cpu_ratio_row(cpu_mem, cpu_pc))
    loader.engine.memory.tier.clear("bench")

    if device == "cpu":
        return
    r.say("resident on the same GPU")
    held = loader.load(fid, device=device, shared=True)
    try:
        check()
        t_gpu, cpu_gpu = r.timed(load("gpu"), sync)
        r.rate("resident_gpu", f"Loader.load -> {device}, resident there", t_gpu, cpu_gpu)
        r.report.add(_ratio_row(r, "resident_gpu_vs_page_cache", t_pc, t_gpu, ">= 20x"))
        _shared(r, loader, fid, device)
    finally:
        loader.leases.release(held.id)
    if gpus < 2:
        r.report.add(
            BenchRow("resident_peer", "resident on another GPU", None, "GB/s", note="one GPU")
        )
        return
    r.say("resident on another GPU")
    other = "cuda:1" if device != "cuda:1" else "cuda:0"
    held = loader.load(fid, device=other, shared=True)
    try:
        check()
        t_peer, cpu_peer = r.timed(load("peer"), sync)
        r.rate("resident_peer", f"Loader.load -> {device}, resident on {other}", t_peer, cpu_peer)
        r.report.add(_ratio_row(r, "resident_peer_vs_page_cache", t_pc, t_peer, ">= 5x"))
    finally:
        loader.leases.release(held.id)


def _prefetch_memory(loader: Any, fid: int) -> None:
    """Prefetch ``fid`` into the memory tier and wait for the job to finish."""
    job = loader.prefetch([fid], target="memory")
    while not job.finished:
        time.sleep(0.05)
    if job.state != "done":
        raise RuntimeError(f"prefetch into memory ended {job.state}: {job.errors}")


def _cpu_ratio_row(cpu_mem: float, cpu_pc: float) -> BenchRow:
    """CPU seconds of a memory-tier load against a page-cache load's."""
    cpu_ratio = (cpu_mem / cpu_pc) if cpu_pc > 0 else None
    met = cpu_ratio is not None and cpu_ratio <= 0.1
    return BenchRow(
        "memory_cpu_vs_page_cache",
        "  CPU-s/GB, memory tier / page cache",
        cpu_ratio,
        "x",
        target="<= 0.1x",
        met=met,
    )


def _shared(r: _Run, loader: Any, fid: int, device: str) -> None:
    """A second ``shared=True`` load of a resident file: time to the lease, bytes added."""
    before = loader.leases.leased_bytes().get(device, 0)
    times: list[float] = []
    added = 0
    for _ in range(max(3, r.repeats)):
        t0 = time.perf_counter()
        lease = loader.load(fid, device=device, shared=True)
        times.append(time.perf_counter() - t0)
        added = max(added, loader.leases.leased_bytes().get(device, 0) - before)
        loader.leases.release(lease.id)
    ms = statistics.median(times) * 1e3
    r.report.add(
        BenchRow(
            "shared_reply_ms",
            "second shared=true load (in process)",
            ms,
            "ms",
            target="<= 5 ms",
            met=ms <= 5,
        )
    )
    r.report.add(
        BenchRow(
            "shared_extra_bytes",
            "  device bytes it added",
            float(added),
            "B",
            target="0",
            met=added == 0,
        )
    )


def _ratio_row(r: _Run, key: str, t_ref: float, t: float, target: str) -> BenchRow:
    ratio = t_ref / t if t > 0 else None
    want = float(target.split()[1].rstrip("x"))
    return BenchRow(
        key, f"  ratio {key}", ratio, "x", target=target, met=ratio is not None and ratio >= want
    )


def _gpu_count() -> int:
    try:
        import cupy as cp

        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def _syncer(device: str) -> Callable[[], None]:
    if device == "cpu":
        return lambda: None
    import cupy as cp

    index = int(device.split(":")[1])
    return lambda: cp.cuda.Device(index).synchronize()
