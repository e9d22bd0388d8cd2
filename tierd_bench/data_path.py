"""``tierd bench`` / ``tierd bench data``: this host's ceilings, the usual baselines and
tierd's data path, in one run.

Every figure is the median of ``repeats`` timed runs after a warm-up; GPU timings synchronise
the device before reading the clock. Ratios compare figures taken in this one run. The
measuring is in :mod:`._peers` (what tierd is compared with) and :mod:`._tierd_io` (tierd).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiering.io import GpuDirectStorage

from . import _peers, _tierd_io
from ._datafiles import drop_cache, workdir, write_data, write_shards
from ._datarun import DataRun
from ._measure import GiB, MiB, default_device, format_size, gpu_name
from ._report import Report, describe_device

__all__ = ["run_bench"]


def _kvikio_defaults() -> dict[str, Any]:
    # Read before any GpuDirectStorage grows KvikIO's thread pool: "KvikIO out of the box".
    with contextlib.suppress(ImportError):
        kd = importlib.import_module("kvikio.defaults")
        return {"num_threads": kd.get("num_threads"), "task_size": kd.get("task_size")}
    return {}


def _compare(report: Report, cuda: bool) -> None:
    # Targets: README "Performance". On a GPU the hot load is held to the copy ceiling; in
    # host memory there is no such ceiling, so to the plain np.fromfile a user would write.
    if cuda:
        report.compare("tierd_hot", "ceil_pinned_h2d", 0.9)
        for key in ("ref_kvikio_tuned", "base_fromfile", "base_kvikio"):
            report.compare(key, "ceil_pinned_h2d")
    else:
        report.compare("tierd_hot", "base_fromfile", 2.0)
    report.compare("tierd_cold", "ceil_odirect", 0.95)
    report.compare("tierd_gather", "ref_gather_kvikio")
    report.compare("tierd_safetensors", "base_safetensors", 5.0)


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
) -> Report:
    """Run every data-path measurement and return the report.

    Test files (``size`` bytes of data, plus ``shards`` safetensors shards of ``size`` bytes
    in total) go to a temporary directory under ``directory`` (default: the current one; keep
    it off tmpfs, or the cold figures mean nothing) and are removed afterwards.
    """
    if size < 1 * MiB:
        raise ValueError("size must be at least 1 MiB")
    device = default_device() if device == "auto" else device
    kvikio_defaults = _kvikio_defaults()
    with workdir(directory) as work:
        say(f"writing {format_size(size)} of test files to {work}")
        data = work / "data.bin"
        write_data(data, size)
        shard_paths = write_shards(work, size, shards)
        with GpuDirectStorage(device) as probe:
            setup: dict[str, Any] = {
                "device": device,
                "gpu": gpu_name(device),
                "backend": probe.backend,
                "backend_reason": probe.backend_reason,
                "gds_available": probe.gds_available,
                "size_bytes": size,
                "shards": shards,
                "repeats": repeats,
                "directory": str(work),
                "can_drop_caches": drop_cache(data) < 0.05,
                "kvikio_defaults": kvikio_defaults,
            }
        report = Report(
            "data",
            f"tierd bench data: {describe_device(setup)}, "
            f"backend {setup['backend']}, "
            f"GDS {'yes' if setup['gds_available'] else 'no'}, {format_size(size)} file, "
            f"medians of {repeats}",
            setup,
        )
        if not setup["can_drop_caches"]:
            cold = False
            say("cannot evict the test file from the page cache here: cold figures skipped")
        setup["cold"] = cold
        run = DataRun(
            size, device, work, repeats, rows, row_bytes, cold, say, report, kvikio_defaults
        )
        _peers.ceilings(run, data)
        _peers.baselines(run, data, shard_paths)
        _tierd_io.loads(run, data)
        n = _tierd_io.gather(run, data)
        if run.cuda:
            _peers.kvikio_per_row(run, data, n)
        _tierd_io.safetensors(run, shard_paths)
        if sweep:
            _tierd_io.sweep_hot(run, data)
            if run.cuda:
                _peers.kvikio_sweep(run, data)
            if run.cold:
                _tierd_io.sweep_cold(run, data)
    _compare(report, run.cuda)
    return report
