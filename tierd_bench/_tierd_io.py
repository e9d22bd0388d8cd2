"""tierd's own data path, measured: whole-file loads hot and cold, 4 KiB read latency, random
row gathers, safetensors checkpoints, and (on request) a sweep of its I/O settings.

Everything goes through :class:`tiering.io.GpuDirectStorage`, as the service's loads do, so
the figures include its backend choice and its hot/cold settings.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import time
from pathlib import Path
from typing import Any

import numpy as np

from tiering.io import GdsConfig, GpuDirectStorage, TierIo

from ._datafiles import drop_cache, warm
from ._datarun import DataRun
from ._measure import MiB, free_gpu, gbps, percentile
from ._report import BenchRow

__all__ = ["gather", "loads", "safetensors", "sweep_cold", "sweep_hot"]


def loads(run: DataRun, data: Path) -> None:
    """A whole file, hot and (when the cache can be dropped) cold; then 4 KiB latency."""
    run.say("tierd")
    warm(data)
    with run.storage() as gds, gds.open_file(data) as f:
        last: list[Any] = [None]

        def load() -> None:
            last[0] = None  # free the previous array first: same memory footprint per run
            last[0] = gds.read(f)

        t = run.timed(load, warmup=2)
        r = last[0].report
        io = gds.config.io_for("bench", 0)
        note = f"(path={r.io_path}, {io.threads} threads x {io.task_size >> 20} MiB)"
        run.rate("tierd_hot", "tierd load, hot", run.size, t, note=note)
        last[0] = None
        free_gpu()
        if run.cold:
            t = run.cold_timed(data, load)
            r = last[0].report
            note = f"(path={r.io_path}, cold settings used={r.cold})"
            run.rate("tierd_cold", "tierd load, cold", run.size, t, note=note)
            last[0] = None
            free_gpu()
        _latency(run, gds, f, data)


def _latency(run: DataRun, gds: GpuDirectStorage, f: Any, data: Path) -> None:
    buf = gds.device.empty(4096)
    pages = run.size // 4096
    rng = np.random.default_rng(5)

    def sample(n: int) -> list[float]:
        out = []
        for off in rng.integers(0, pages, n) * 4096:
            t0 = time.perf_counter()
            gds.load_to_gpu(f, int(off), buf)  # synchronous: returns once the bytes landed
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    sample(500)  # warm-up
    hot = sample(5000)
    p50 = percentile(hot, 50)
    run.add(
        BenchRow(
            "lat_hot_p50",
            "4 KiB read latency, hot, p50",
            p50,
            "us",
            target="<= 20 us",
            met=p50 <= 20,
        )
    )
    run.add(BenchRow("lat_hot_p99", "4 KiB read latency, hot, p99", percentile(hot, 99), "us"))
    if run.cold:
        drop_cache(data)
        cold = sample(1000)
        p99 = percentile(cold, 99)
        run.add(
            BenchRow("lat_cold_p50", "4 KiB read latency, cold, p50", percentile(cold, 50), "us")
        )
        run.add(
            BenchRow(
                "lat_cold_p99",
                "4 KiB read latency, cold, p99",
                p99,
                "us",
                target="<= 100 us",
                met=p99 <= 100,
            )
        )


def gather(run: DataRun, data: Path) -> int:
    """Random rows of ``run.row_bytes`` gathered into one array; returns how many per gather."""
    nrows = run.size // run.row_bytes
    n = min(run.rows, nrows)
    nbytes = n * run.row_bytes
    rng = np.random.default_rng(9)
    warm(data)
    with run.storage() as gds, gds.open_file(data) as f:

        def once() -> None:
            # Fresh random rows every run: no run finds its rows' mappings warm.
            gds.gather(f, rng.integers(0, nrows, n), run.row_bytes, np.uint8)

        t0 = time.perf_counter()
        once()
        run.sync()
        first = time.perf_counter() - t0
        t = run.timed(once, max(run.repeats, 5))
        run.rate(
            "tierd_gather",
            f"gather {n} random {run.row_bytes} B rows, hot",
            nbytes,
            t,
            target=">= 5 GB/s",
            met=gbps(nbytes, t[0]) >= 5,
            note=f"(first call, mapping the file: {first * 1e3:.0f} ms)",
        )
    return n


def safetensors(run: DataRun, shards: list[Path]) -> None:
    """A checkpoint of ``shards`` safetensors files into arrays on the device, hot."""
    total = sum(p.stat().st_size for p in shards)
    for p in shards:
        warm(p)
    with run.storage() as gds:
        last: list[Any] = [None]

        def load() -> None:
            last[0] = None
            last[0] = gds.load_safetensors(shards)

        t = run.timed(load, warmup=2)
        paths = {r.io_path for r in last[0].reports.values()}
        label = f"tierd safetensors, {len(shards)} shards, hot"
        run.rate("tierd_safetensors", label, total, t, note=f"(path={','.join(sorted(paths))})")
        last[0] = None
        free_gpu()


def _kvikio_pool(threads: int) -> contextlib.AbstractContextManager[Any]:
    # On the KvikIO backend tierd's reads run on KvikIO's one thread pool, so a setting is
    # only tested as such when that pool has the setting's size too.
    try:
        kvikio_defaults = importlib.import_module("kvikio.defaults")
    except ImportError:
        return contextlib.nullcontext()
    pool: contextlib.AbstractContextManager[Any] = kvikio_defaults.set({"num_threads": threads})
    return pool


def sweep_hot(run: DataRun, data: Path) -> None:
    """Hot loads over threads x task size."""
    run.say("sweep: hot load by threads x task size")
    warm(data)
    for threads, task in [(8, 8), (16, 4), (16, 8), (16, 16), (24, 8), (32, 8)]:
        io = TierIo(threads=threads, task_size=task * MiB)
        with _kvikio_pool(threads), run.storage(io) as gds, gds.open_file(data) as f:
            t = run.timed(functools.partial(gds.read, f))
        label = f"  tierd hot, {threads} threads x {task} MiB"
        run.rate(f"sweep_hot_{threads}x{task}", label, run.size, t)
        free_gpu()


def sweep_cold(run: DataRun, data: Path) -> None:
    """Cold loads over the cold settings' threads x task size."""
    for threads, task in [(1, 16), (2, 16), (4, 8), (8, 4)]:
        cfg = GdsConfig(cold_io=TierIo(threads=threads, task_size=task * MiB))
        with GpuDirectStorage(run.device, cfg) as gds, gds.open_file(data) as f:
            t = run.cold_timed(data, functools.partial(gds.read, f), 1)
        label = f"  cold, {threads} threads x {task} MiB"
        run.rate(f"sweep_cold_{threads}x{task}", label, run.size, t)
        free_gpu()
