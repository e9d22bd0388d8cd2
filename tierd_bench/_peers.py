"""What tierd's data path is measured against: this host's ceilings and other loaders.

Ceilings are what no loader can beat here (a pinned host → device copy, an O_DIRECT read of the
disk); baselines are what a user gets without tierd (``np.fromfile``, ``safetensors``, KvikIO
as installed); references are peers tuned by hand. Each is measured in the same run as tierd,
because machines of one kind differ and only ratios within one run compare.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any

import numpy as np

from ._datafiles import odirect_read, warm
from ._datarun import DataRun
from ._measure import GiB, MiB, free_gpu, frees_gpu
from ._report import BenchRow

__all__ = ["baselines", "ceilings", "kvikio_per_row", "kvikio_sweep"]


def ceilings(run: DataRun, data: Path) -> None:
    """The pinned host → device copy (hot ceiling) and O_DIRECT reads (cold ceiling)."""
    run.say("ceilings")
    if run.cuda:
        cp = importlib.import_module("cupy")
        n = min(GiB, run.size)
        host = cp.cuda.alloc_pinned_memory(n)
        src = np.frombuffer(host, np.uint8, n)
        src[:] = 1
        dst = cp.empty(n, cp.uint8)
        # More runs than elsewhere: each is short, and this figure is every ratio's yardstick.
        t = run.timed(lambda: dst.set(src), max(5, run.repeats))
        run.rate("ceil_pinned_h2d", "pinned host -> device copy", n, t)
        del dst, host, src
        free_gpu()
    if run.cold:
        timings = []
        for threads in (1, 4):
            t = run.cold_timed(data, functools.partial(odirect_read, data, threads))
            label = f"O_DIRECT read, {threads} thread(s), cold"
            run.rate(f"odirect_{threads}t", label, run.size, t)
            timings.append(t)
        best = min(timings)  # the fastest, with its own CPU cost
        run.rate("ceil_odirect", "O_DIRECT ceiling (best of above)", run.size, best)


@frees_gpu
def _kvikio(run: DataRun, data: Path) -> None:
    cp = importlib.import_module("cupy")
    try:
        kvikio = importlib.import_module("kvikio")
        kvikio_defaults = importlib.import_module("kvikio.defaults")
    except ImportError:
        run.add(BenchRow("base_kvikio", "KvikIO defaults, hot", None, "GB/s", note="not installed"))
        return
    buf = cp.empty(run.size, cp.uint8)
    nthreads = run.kvikio_defaults.get("num_threads", 1)

    def kv() -> None:
        with kvikio.CuFile(data, "r") as f:
            f.read(buf)

    with kvikio_defaults.set(run.kvikio_defaults):
        t = run.timed(kv)
    note = f"({nthreads} thread(s), compat={kvikio_defaults.get('compat_mode')})"
    run.rate("base_kvikio", "KvikIO defaults, hot", run.size, t, note=note)
    with kvikio_defaults.set({"num_threads": 16, "task_size": 4 * MiB}):
        t = run.timed(kv)
    label = "KvikIO 16 threads, 4 MiB tasks, hot"
    run.rate("ref_kvikio_tuned", label, run.size, t, note="(tuned by hand, reference)")


def baselines(run: DataRun, data: Path, shards: list[Path]) -> None:
    """``np.fromfile`` (+ copy), KvikIO as installed and tuned, ``safetensors`` load_file."""
    run.say("baselines")
    warm(data)
    if run.cuda:
        cp = importlib.import_module("cupy")
        t = run.timed(lambda: cp.asarray(np.fromfile(data, dtype=np.uint8)))
        run.rate("base_fromfile", "np.fromfile + copy to GPU, hot", run.size, t)
        free_gpu()
        _kvikio(run, data)
    else:
        t = run.timed(lambda: np.fromfile(data, dtype=np.uint8))
        run.rate("base_fromfile", "np.fromfile, hot", run.size, t)
    _safetensors(run, shards)


def _safetensors(run: DataRun, shards: list[Path]) -> None:
    total = sum(p.stat().st_size for p in shards)
    module, label = (
        ("safetensors.torch", "safetensors.torch.load_file(device=cuda), hot")
        if run.cuda
        else ("safetensors.numpy", "safetensors.numpy.load_file, hot")
    )
    try:
        st = importlib.import_module(module)
    except ImportError as exc:  # safetensors.torch needs torch, which a host may lack
        run.add(BenchRow("base_safetensors", "safetensors load_file", None, "GB/s", note=str(exc)))
        return
    kwargs: dict[str, Any] = {"device": run.device} if run.cuda else {}

    def load() -> None:
        for p in shards:
            st.load_file(str(p), **kwargs)

    t = run.timed(load)
    run.rate("base_safetensors", label, total, t, note=f"({len(shards)} shards)")
    free_gpu()


@frees_gpu
def kvikio_per_row(run: DataRun, data: Path, n: int) -> None:
    """``n`` random rows read with one KvikIO ``pread`` each: the obvious way to gather."""
    try:
        kvikio = importlib.import_module("kvikio")
        kvikio_defaults = importlib.import_module("kvikio.defaults")
        cp = importlib.import_module("cupy")
    except ImportError:
        return
    nrows = run.size // run.row_bytes
    rb = run.row_bytes
    rng = np.random.default_rng(9)
    buf = cp.empty(n * rb, cp.uint8)

    def per_row() -> None:
        with kvikio.CuFile(data, "r") as fh:
            offs = rng.integers(0, nrows, n) * rb
            futs = [fh.pread(buf[i * rb : (i + 1) * rb], rb, int(o)) for i, o in enumerate(offs)]
            for fu in futs:
                fu.get()

    with kvikio_defaults.set({"num_threads": 16}):
        t = run.timed(per_row)
    run.rate("ref_gather_kvikio", "KvikIO one pread per row, hot", n * rb, t, note="(16 threads)")


@frees_gpu
def kvikio_sweep(run: DataRun, data: Path) -> None:
    """KvikIO's own pool over threads x task size, to set beside tierd's sweep."""
    try:
        kvikio = importlib.import_module("kvikio")
        kvikio_defaults = importlib.import_module("kvikio.defaults")
        cp = importlib.import_module("cupy")
    except ImportError:
        return
    buf = cp.empty(run.size, cp.uint8)
    for threads, task in [(16, 8), (24, 4), (24, 8), (32, 4)]:

        def kv(task: int = task) -> None:
            with kvikio.CuFile(data, "r") as f:
                f.read(buf, task_size=task * MiB)

        with kvikio_defaults.set({"num_threads": threads}):
            t = run.timed(kv)
        label = f"  KvikIO pool, {threads} threads x {task} MiB"
        run.rate(f"sweep_kvikio_{threads}x{task}", label, run.size, t)
