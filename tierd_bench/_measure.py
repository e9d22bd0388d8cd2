"""How every ``tierd bench`` sub-benchmark times things: medians, percentiles, sizes, devices.

One definition of each, so that figures from different sub-benchmarks mean the same thing: a
figure is the median of timed runs after a warm-up, with the device synchronised before the
clock is read, and a percentile interpolates between samples the way ``numpy.percentile`` does.
CuPy and torch are imported only when a CUDA device is asked for.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

__all__ = [
    "GiB",
    "MiB",
    "default_device",
    "device_sync",
    "format_size",
    "free_gpu",
    "frees_gpu",
    "gbps",
    "gpu_name",
    "parse_size",
    "percentile",
    "timed",
    "timed_cpu",
]

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


def format_size(nbytes: int) -> str:
    """``4 GiB``, ``1.50 MiB``, ``4 KiB``: binary units, as sizes are given on the command line."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{nbytes} B"


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s, as the device README and NVIDIA quote bandwidths."""
    return nbytes / seconds / 1e9


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linearly interpolated like ``numpy.percentile``."""
    if not samples:
        raise ValueError("percentile of no samples")
    s = sorted(samples)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _no_sync() -> None:
    pass


def device_sync(device: str) -> Callable[[], None]:
    """What to call before reading the clock: a synchronise of ``device`` for ``cuda:N``.

    Work queued on a GPU stream returns before the bytes land; without a synchronise the clock
    would time the queueing, not the copy.
    """
    if not device.startswith("cuda"):
        return _no_sync
    cp = importlib.import_module("cupy")
    gpu = cp.cuda.Device(int(device.partition(":")[2] or 0))

    def sync() -> None:
        gpu.synchronize()

    return sync


def timed_cpu(
    fn: Callable[[], Any],
    repeats: int,
    *,
    warmup: int = 1,
    sync: Callable[[], None] = _no_sync,
    cpu_clock: Callable[[], float] = time.process_time,
    before: Callable[[], object] | None = None,
) -> tuple[float, float]:
    """Median seconds and median CPU seconds of ``fn`` over ``repeats`` runs after ``warmup``
    untimed runs; ``before()`` runs ahead of each timed run, off the clock (dropping a file
    from the page cache, say).

    CPU seconds are this process's, user and system, every thread counted (``process_time``):
    a data path that is fast because it keeps every core busy is not fast on an inference
    host, so figures carry their CPU cost. The first call after a start is often several times
    slower (pools, mappings, page tables are being made), so it is never timed.
    """
    for _ in range(warmup):
        fn()
        sync()
    times, cpus = [], []
    for _ in range(repeats):
        if before is not None:
            before()
        sync()
        c0, t0 = cpu_clock(), time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        cpus.append(cpu_clock() - c0)
    return statistics.median(times), statistics.median(cpus)


def timed(
    fn: Callable[[], Any],
    repeats: int,
    *,
    warmup: int = 1,
    sync: Callable[[], None] = _no_sync,
    before: Callable[[], object] | None = None,
) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after ``warmup`` untimed runs (see
    :func:`timed_cpu`)."""
    return timed_cpu(fn, repeats, warmup=warmup, sync=sync, before=before)[0]


def free_gpu() -> None:
    """Give cached GPU memory back between figures, so one figure's pool never starves the next."""
    with contextlib.suppress(Exception):
        importlib.import_module("cupy").get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules:  # only if something already imported it: torch is slow to import
        with contextlib.suppress(Exception):
            sys.modules["torch"].cuda.empty_cache()


P = ParamSpec("P")
R = TypeVar("R")


def frees_gpu(fn: Callable[P, R]) -> Callable[P, R]:
    """Call :func:`free_gpu` once ``fn`` has returned and its local buffers are gone.

    Inside ``fn`` the buffers its timed closures use are still referenced, so it cannot free
    them itself.
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        finally:
            free_gpu()

    return wrapper


def default_device() -> str:
    """``cuda:0`` when CuPy sees a GPU, else ``cpu``: what ``--device auto`` means."""
    try:
        cp = importlib.import_module("cupy")
        return "cuda:0" if cp.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:  # no CuPy, no driver, no device: all mean "measure host memory"
        return "cpu"


def gpu_name(device: str) -> str | None:
    """The GPU's name for ``cuda:N`` (``None`` for ``cpu`` or when CuPy cannot say)."""
    if not device.startswith("cuda"):
        return None
    with contextlib.suppress(Exception):  # a description must never fail a finished run
        cp = importlib.import_module("cupy")
        props = cp.cuda.runtime.getDeviceProperties(int(device.partition(":")[2] or 0))
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    return None
