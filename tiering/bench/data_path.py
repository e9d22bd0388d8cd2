"""``tierd bench``: this host's ceilings, the usual baselines and tierd's paths, in one run.

Every figure is the median of ``repeats`` timed runs after a warm-up; GPU timings synchronise
the device before reading the clock. Ratios compare figures taken in this one run.
Run it as ``tierd bench`` or ``python -m tiering.bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import mmap
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tiering.config import TierConfig
from tiering.io import GdsConfig, GpuDirectStorage, TierIo
from tiering.io import _pagecache as pagecache

__all__ = ["BenchRow", "main", "parse_size", "render", "run_bench"]

MiB = 1 << 20
GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
_IUNITS = {"ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_size(text: str) -> int:
    """Parse ``4GiB``, ``512MiB``, ``1G`` (10**9), ``4096`` into bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 4GiB, 512MiB, 1G)")
    unit = m.group(2) or ""
    scale = _IUNITS[unit] if unit.endswith("i") else _UNITS[unit]
    return int(float(m.group(1)) * scale)


@dataclass
class BenchRow:
    """One measured figure, optionally compared with another row and a target."""

    key: str
    label: str
    value: float | None
    unit: str
    vs: str | None = None
    ratio: float | None = None
    target: str | None = None
    met: bool | None = None
    note: str = ""


@dataclass
class _Ctx:
    size: int
    device: str
    directory: Path
    repeats: int
    rows: int
    row_bytes: int
    shards: int
    cold: bool
    sweep: bool
    say: Callable[[str], None]
    results: dict[str, BenchRow] = field(default_factory=dict)
    kvikio_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def add(self, row: BenchRow) -> BenchRow:
        self.results[row.key] = row
        value = "-" if row.value is None else f"{row.value:.3f} {row.unit}"
        self.say(f"  {row.label}: {value} {row.note}")
        return row


def _sync(cuda: bool) -> None:
    if cuda:
        importlib.import_module("cupy").cuda.runtime.deviceSynchronize()


def _timed(fn: Callable[[], Any], cuda: bool, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
        _sync(cuda)
    times = []
    for _ in range(repeats):
        _sync(cuda)
        t0 = time.perf_counter()
        fn()
        _sync(cuda)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _free_gpu() -> None:
    with contextlib.suppress(Exception):
        cp = importlib.import_module("cupy")
        cp.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules:
        with contextlib.suppress(Exception):
            sys.modules["torch"].cuda.empty_cache()


def drop_cache(path: Path) -> float:
    """Evict ``path`` from the page cache; returns the fraction still resident."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        pagecache.drop(fd)
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
        return pagecache.residency(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _write_data(path: Path, size: int) -> None:
    block = np.random.default_rng(0).integers(0, 256, size=min(size, 64 * MiB), dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < size:
            n = min(block.size, size - done)
            done += os.pwrite(fd, block.data[:n], done)
        os.fsync(fd)  # clean pages, so that they can be dropped for the cold runs
    finally:
        os.close(fd)


def _write_shards(directory: Path, total: int, shards: int) -> list[Path]:
    from safetensors.numpy import save_file

    paths = []
    per = max(total // shards, 8 * 4096)
    for s in range(shards):
        # Eight tensors per shard, of mixed dtypes, like a real checkpoint shard.
        tensors: dict[str, np.ndarray] = {}
        each = per // 8
        for i in range(8):
            dtype = (np.float32, np.float16, np.int8, np.float32)[i % 4]
            n = max(1, each // np.dtype(dtype).itemsize)
            tensors[f"layers.{s}.w{i}"] = np.full(n, i, dtype=dtype)
        path = directory / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(path))
        del tensors
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        paths.append(path)
    return paths


def _odirect_read(path: Path, threads: int, block: int = 16 * MiB) -> None:
    size = path.stat().st_size
    chunks = [(o, min(block, size - o)) for o in range(0, size, block)]
    lock = threading.Lock()

    def worker() -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        buf = mmap.mmap(-1, block)  # page aligned, as O_DIRECT needs
        try:
            while True:
                with lock:
                    if not chunks:
                        return
                    off, n = chunks.pop(0)
                aligned = -(-n // 4096) * 4096
                os.preadv(fd, [memoryview(buf)[:aligned]], off)
        finally:
            buf.close()
            os.close(fd)

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _warm(path: Path) -> None:
    """Pull a file back into the page cache (after cold runs dropped it)."""
    buf = bytearray(64 * MiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        while n := os.preadv(fd, [buf], off):
            off += n
    finally:
        os.close(fd)


def _cold_timed(ctx: _Ctx, path: Path, fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        drop_cache(path)
        _sync(ctx.cuda)
        t0 = time.perf_counter()
        fn()
        _sync(ctx.cuda)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _ratio(ctx: _Ctx, key: str, vs: str, target: float | None = None, op: str = ">=") -> None:
    row, ref = ctx.results.get(key), ctx.results.get(vs)
    if row is None or ref is None or row.value is None or not ref.value:
        return
    row.vs, row.ratio = vs, row.value / ref.value
    if target is not None:
        row.target = f"{op} {target:g}x {ref.label}"
        row.met = row.ratio >= target


def _storage(ctx: _Ctx, io: TierIo | None = None) -> GpuDirectStorage:
    config = GdsConfig() if io is None else GdsConfig(fast_tier_io=io)
    return GpuDirectStorage(ctx.device, config, [TierConfig("bench", ctx.directory)])


# -- the measurements -------------------------------------------------------------------------


def _ceilings(ctx: _Ctx, data: Path) -> None:
    ctx.say("ceilings")
    if ctx.cuda:
        cp = importlib.import_module("cupy")
        n = min(GiB, ctx.size)
        host = cp.cuda.alloc_pinned_memory(n)
        src = np.frombuffer(host, np.uint8, n)
        src[:] = 1
        dst = cp.empty(n, cp.uint8)
        t = _timed(lambda: dst.set(src), True, max(5, ctx.repeats))
        ctx.add(BenchRow("ceil_pinned_h2d", "pinned host -> device copy", _gbps(n, t), "GB/s"))
        del dst, host, src
        _free_gpu()
    if ctx.cold:
        best = None
        for threads in (1, 4):
            t = _cold_timed(ctx, data, functools.partial(_odirect_read, data, threads), ctx.repeats)
            ctx.add(
                BenchRow(
                    f"odirect_{threads}t",
                    f"O_DIRECT read, {threads} thread(s), cold",
                    _gbps(ctx.size, t),
                    "GB/s",
                )
            )
            best = max(best or 0.0, _gbps(ctx.size, t))
        ctx.add(BenchRow("ceil_odirect", "O_DIRECT ceiling (best of above)", best, "GB/s"))


def _baselines(ctx: _Ctx, data: Path, shards: list[Path]) -> None:
    ctx.say("baselines")
    _warm(data)
    if ctx.cuda:
        cp = importlib.import_module("cupy")

        def fromfile() -> None:
            cp.asarray(np.fromfile(data, dtype=np.uint8))

        t = _timed(fromfile, True, ctx.repeats)
        ctx.add(
            BenchRow("base_fromfile", "np.fromfile + copy to GPU, hot", _gbps(ctx.size, t), "GB/s")
        )
        _free_gpu()
        try:
            kvikio = importlib.import_module("kvikio")
            kvikio_defaults = importlib.import_module("kvikio.defaults")
        except ImportError:
            ctx.add(
                BenchRow("base_kvikio", "KvikIO defaults, hot", None, "GB/s", note="not installed")
            )
        else:
            buf = cp.empty(ctx.size, cp.uint8)
            nthreads = ctx.kvikio_defaults.get("num_threads", 1)

            def kv() -> None:
                with kvikio.CuFile(data, "r") as f:
                    f.read(buf)

            with kvikio_defaults.set(ctx.kvikio_defaults):
                t = _timed(kv, True, ctx.repeats)
            ctx.add(
                BenchRow(
                    "base_kvikio",
                    "KvikIO defaults, hot",
                    _gbps(ctx.size, t),
                    "GB/s",
                    note=f"({nthreads} thread(s), compat={kvikio_defaults.get('compat_mode')})",
                )
            )
            with kvikio_defaults.set({"num_threads": 16, "task_size": 4 * MiB}):
                t = _timed(kv, True, ctx.repeats)
            ctx.add(
                BenchRow(
                    "ref_kvikio_tuned",
                    "KvikIO 16 threads, 4 MiB tasks, hot",
                    _gbps(ctx.size, t),
                    "GB/s",
                    note="(tuned by hand, reference)",
                )
            )
            del buf
            _free_gpu()
    else:
        t = _timed(lambda: np.fromfile(data, dtype=np.uint8), False, ctx.repeats)
        ctx.add(BenchRow("base_fromfile", "np.fromfile, hot", _gbps(ctx.size, t), "GB/s"))
    total = sum(p.stat().st_size for p in shards)
    try:
        if ctx.cuda:
            st_torch = importlib.import_module("safetensors.torch")

            def st_load() -> None:
                for p in shards:
                    st_torch.load_file(str(p), device=ctx.device)

            label = "safetensors.torch.load_file(device=cuda), hot"
        else:
            st_np = importlib.import_module("safetensors.numpy")

            def st_load() -> None:
                for p in shards:
                    st_np.load_file(str(p))

            label = "safetensors.numpy.load_file, hot"
    except ImportError as exc:
        ctx.add(
            BenchRow("base_safetensors", "safetensors load_file", None, "GB/s", note=f"({exc})")
        )
        return
    t = _timed(st_load, ctx.cuda, ctx.repeats)
    ctx.add(
        BenchRow("base_safetensors", label, _gbps(total, t), "GB/s", note=f"({len(shards)} shards)")
    )
    _free_gpu()


def _tierd_loads(ctx: _Ctx, data: Path) -> None:
    ctx.say("tierd")
    _warm(data)
    with _storage(ctx) as gds, gds.open_file(data) as f:
        last: list[Any] = [None]

        def hot() -> None:
            last[0] = None  # free the previous array first: same memory footprint per run
            last[0] = gds.read(f)

        t = _timed(hot, ctx.cuda, ctx.repeats, warmup=2)
        r = last[0].report
        io = gds.config.io_for("bench", 0)
        ctx.add(
            BenchRow(
                "tierd_hot",
                "tierd load, hot",
                _gbps(ctx.size, t),
                "GB/s",
                note=f"(path={r.io_path}, {io.threads} threads x {io.task_size >> 20} MiB)",
            )
        )
        last[0] = None
        _free_gpu()
        if ctx.cold:
            t = _cold_timed(ctx, data, hot, ctx.repeats)
            r = last[0].report
            ctx.add(
                BenchRow(
                    "tierd_cold",
                    "tierd load, cold",
                    _gbps(ctx.size, t),
                    "GB/s",
                    note=f"(path={r.io_path}, cold settings used={r.cold})",
                )
            )
            last[0] = None
            _free_gpu()
        _latency(ctx, gds, f, data)


def _latency(ctx: _Ctx, gds: GpuDirectStorage, f: Any, data: Path) -> None:
    buf = gds.device.empty(4096)
    pages = ctx.size // 4096
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
    ctx.add(
        BenchRow(
            "lat_hot_p50",
            "4 KiB read latency, hot, p50",
            float(np.percentile(hot, 50)),
            "us",
            target="<= 20 us",
            met=float(np.percentile(hot, 50)) <= 20,
        )
    )
    ctx.add(
        BenchRow("lat_hot_p99", "4 KiB read latency, hot, p99", float(np.percentile(hot, 99)), "us")
    )
    if ctx.cold:
        drop_cache(data)
        cold = sample(1000)
        p99 = float(np.percentile(cold, 99))
        ctx.add(
            BenchRow(
                "lat_cold_p50",
                "4 KiB read latency, cold, p50",
                float(np.percentile(cold, 50)),
                "us",
            )
        )
        ctx.add(
            BenchRow(
                "lat_cold_p99",
                "4 KiB read latency, cold, p99",
                p99,
                "us",
                target="<= 100 us",
                met=p99 <= 100,
            )
        )


def _gather(ctx: _Ctx, data: Path) -> None:
    nrows = ctx.size // ctx.row_bytes
    n = min(ctx.rows, nrows)
    nbytes = n * ctx.row_bytes
    rng = np.random.default_rng(9)
    _warm(data)
    with _storage(ctx) as gds, gds.open_file(data) as f:

        def once() -> None:
            # Fresh random rows every run: no run finds its rows' mappings warm.
            gds.gather(f, rng.integers(0, nrows, n), ctx.row_bytes, np.uint8)

        t0 = time.perf_counter()
        once()
        _sync(ctx.cuda)
        first = time.perf_counter() - t0
        t = _timed(once, ctx.cuda, max(ctx.repeats, 5))
        ctx.add(
            BenchRow(
                "tierd_gather",
                f"gather {n} random {ctx.row_bytes} B rows, hot",
                _gbps(nbytes, t),
                "GB/s",
                target=">= 5 GB/s",
                met=_gbps(nbytes, t) >= 5,
                note=f"(first call, mapping the file: {first * 1e3:.0f} ms)",
            )
        )
    if ctx.cuda:
        with contextlib.suppress(ImportError):
            kvikio = importlib.import_module("kvikio")
            kvikio_defaults = importlib.import_module("kvikio.defaults")
            cp = importlib.import_module("cupy")
            buf = cp.empty(nbytes, cp.uint8)

            def per_row() -> None:
                with kvikio.CuFile(data, "r") as fh:
                    offs = rng.integers(0, nrows, n) * ctx.row_bytes
                    futs = [
                        fh.pread(
                            buf[i * ctx.row_bytes : (i + 1) * ctx.row_bytes], ctx.row_bytes, int(o)
                        )
                        for i, o in enumerate(offs)
                    ]
                    for fu in futs:
                        fu.get()

            with kvikio_defaults.set({"num_threads": 16}):
                t = _timed(per_row, True, ctx.repeats)
            ctx.add(
                BenchRow(
                    "ref_gather_kvikio",
                    "KvikIO one pread per row, hot",
                    _gbps(nbytes, t),
                    "GB/s",
                    note="(16 threads)",
                )
            )
            _ratio(ctx, "tierd_gather", "ref_gather_kvikio")


def _safetensors(ctx: _Ctx, shards: list[Path]) -> None:
    total = sum(p.stat().st_size for p in shards)
    for p in shards:
        _warm(p)
    with _storage(ctx) as gds:
        last: list[Any] = [None]

        def load() -> None:
            last[0] = None
            last[0] = gds.load_safetensors(shards)

        t = _timed(load, ctx.cuda, ctx.repeats, warmup=2)
        paths = {r.io_path for r in last[0].reports.values()}
        ctx.add(
            BenchRow(
                "tierd_safetensors",
                f"tierd safetensors, {len(shards)} shards, hot",
                _gbps(total, t),
                "GB/s",
                note=f"(path={','.join(sorted(paths))})",
            )
        )
        last[0] = None
        _free_gpu()


def _sweep(ctx: _Ctx, data: Path) -> None:
    ctx.say("sweep: hot load by threads x task size")
    _warm(data)
    pool: Any = contextlib.nullcontext
    with contextlib.suppress(ImportError):
        kd = importlib.import_module("kvikio.defaults")
        pool = lambda n: kd.set({"num_threads": n})  # noqa: E731 - the pool as tested
    for threads, task in [(8, 8), (16, 4), (16, 8), (16, 16), (24, 8), (32, 8)]:
        io = TierIo(threads=threads, task_size=task * MiB)
        with pool(threads), _storage(ctx, io) as gds, gds.open_file(data) as f:
            t = _timed(functools.partial(gds.read, f), ctx.cuda, ctx.repeats)
        ctx.add(
            BenchRow(
                f"sweep_hot_{threads}x{task}",
                f"  tierd hot, {threads} threads x {task} MiB",
                _gbps(ctx.size, t),
                "GB/s",
            )
        )
        _free_gpu()
    if ctx.cuda:
        with contextlib.suppress(ImportError):
            kvikio = importlib.import_module("kvikio")
            kvikio_defaults = importlib.import_module("kvikio.defaults")
            cp = importlib.import_module("cupy")
            buf = cp.empty(ctx.size, cp.uint8)
            for threads, task in [(16, 8), (24, 4), (24, 8), (32, 4)]:

                def kv(task: int = task) -> None:
                    with kvikio.CuFile(data, "r") as f:
                        f.read(buf, task_size=task * MiB)

                with kvikio_defaults.set({"num_threads": threads}):
                    t = _timed(kv, True, ctx.repeats)
                ctx.add(
                    BenchRow(
                        f"sweep_kvikio_{threads}x{task}",
                        f"  KvikIO pool, {threads} threads x {task} MiB",
                        _gbps(ctx.size, t),
                        "GB/s",
                    )
                )
            del buf
            _free_gpu()
    if ctx.cold:
        for threads, task in [(1, 16), (2, 16), (4, 8), (8, 4)]:
            cfg = GdsConfig(cold_io=TierIo(threads=threads, task_size=task * MiB))
            with GpuDirectStorage(ctx.device, cfg) as gds, gds.open_file(data) as f:
                t = _cold_timed(ctx, data, functools.partial(gds.read, f), 1)
            ctx.add(
                BenchRow(
                    f"sweep_cold_{threads}x{task}",
                    f"  cold, {threads} threads x {task} MiB",
                    _gbps(ctx.size, t),
                    "GB/s",
                )
            )
            _free_gpu()


@contextlib.contextmanager
def _workdir(parent: Path | None) -> Iterator[Path]:
    base = Path(parent) if parent else Path.cwd()
    path = Path(tempfile.mkdtemp(prefix="tierd-bench-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _default_device() -> str:
    try:
        cp = importlib.import_module("cupy")
        return "cuda:0" if cp.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:
        return "cpu"


def run_bench(
    size: int = GiB,
    device: str = "auto",
    directory: Path | None = None,
    *,
    rows: int = 20_000,
    row_bytes: int = 4096,
    shards: int = 4,
    repeats: int = 3,
    cold: bool = True,
    sweep: bool = False,
    say: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Run every measurement; returns ``{"host": {...}, "rows": {key: BenchRow as dict}}``.

    Test files (``size`` bytes of data, plus ``shards`` safetensors shards of ``size`` bytes
    in total) go to a temporary directory under ``directory`` (default: the current one; keep
    it off tmpfs, or the cold figures mean nothing) and are removed afterwards.
    """
    if size < 1 * MiB:
        raise ValueError("size must be at least 1 MiB")
    device = _default_device() if device == "auto" else device
    # KvikIO's own defaults, read before any GpuDirectStorage grows its thread pool.
    kvikio_defaults: dict[str, Any] = {}
    with contextlib.suppress(ImportError):
        kd = importlib.import_module("kvikio.defaults")
        kvikio_defaults = {"num_threads": kd.get("num_threads"), "task_size": kd.get("task_size")}
    with _workdir(directory) as work:
        ctx = _Ctx(size, device, work, repeats, rows, row_bytes, shards, cold, sweep, say)
        ctx.kvikio_defaults = kvikio_defaults
        say(f"writing {size / GiB:.2f} GiB of test files to {work}")
        data = work / "data.bin"
        _write_data(data, size)
        shard_paths = _write_shards(work, size, shards)
        with GpuDirectStorage(device) as probe:
            host = {
                "device": device,
                "backend": probe.backend,
                "backend_reason": probe.backend_reason,
                "gds_available": probe.gds_available,
                "size_bytes": size,
                "cpus": os.cpu_count(),
                "directory": str(work),
                "can_drop_caches": drop_cache(data) < 0.05,
            }
        if not host["can_drop_caches"]:
            ctx.cold = False
            say("cannot evict the test file from the page cache here: cold figures skipped")
        _ceilings(ctx, data)
        _baselines(ctx, data, shard_paths)
        _tierd_loads(ctx, data)
        _gather(ctx, data)
        _safetensors(ctx, shard_paths)
        if sweep:
            _sweep(ctx, data)
    if ctx.cuda:
        _ratio(ctx, "tierd_hot", "ceil_pinned_h2d", 0.9)
        _ratio(ctx, "ref_kvikio_tuned", "ceil_pinned_h2d")
        _ratio(ctx, "base_fromfile", "ceil_pinned_h2d")
        _ratio(ctx, "base_kvikio", "ceil_pinned_h2d")
    else:
        _ratio(ctx, "tierd_hot", "base_fromfile", 2.0)
    _ratio(ctx, "tierd_cold", "ceil_odirect", 0.95)
    _ratio(ctx, "tierd_safetensors", "base_safetensors", 5.0)
    return {"host": host, "rows": {k: asdict(v) for k, v in ctx.results.items()}}


def render(result: dict[str, Any]) -> Any:
    """A rich Table of a :func:`run_bench` result."""
    from rich.table import Table

    host = result["host"]
    table = Table(
        title=(
            f"tierd bench: {host['device']}, backend {host['backend']}, "
            f"GDS {'yes' if host['gds_available'] else 'no'}, "
            f"{host['size_bytes'] / GiB:.2f} GiB file"
        )
    )
    for col in ("measure", "value", "vs", "ratio", "target", "met", "note"):
        table.add_column(col, overflow="fold")
    rows = result["rows"]
    for row in rows.values():
        value = "-" if row["value"] is None else f"{row['value']:.2f} {row['unit']}"
        vs = rows[row["vs"]]["label"] if row["vs"] else ""
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else ""
        met = {True: "yes", False: "NO", None: ""}[row["met"]]
        table.add_row(row["label"], value, vs, ratio, row["target"] or "", met, row["note"])
    return table


def main(argv: list[str] | None = None) -> int:
    """``python -m tiering.bench``: the same as ``tierd bench``."""
    from rich.console import Console

    ap = argparse.ArgumentParser(prog="python -m tiering.bench", description=__doc__)
    ap.add_argument("--size", default="1GiB", help="test file size, e.g. 4GiB")
    ap.add_argument("--device", default="auto", help="cuda:N, cpu or auto")
    ap.add_argument("--dir", type=Path, default=None, help="where to put test files")
    ap.add_argument("--rows", type=int, default=20_000, help="rows per gather")
    ap.add_argument("--shards", type=int, default=4, help="safetensors shards")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median)")
    ap.add_argument("--no-cold", action="store_true", help="skip cold-cache figures")
    ap.add_argument("--sweep", action="store_true", help="also sweep threads x task size")
    ap.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    result = run_bench(
        parse_size(args.size),
        args.device,
        args.dir,
        rows=args.rows,
        shards=args.shards,
        repeats=args.repeats,
        cold=not args.no_cold,
        sweep=args.sweep,
        say=lambda s: console.print(s, markup=False, highlight=False),
    )
    Console(width=200).print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
