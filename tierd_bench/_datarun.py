"""One run of the data-path bench: its settings, its report, and how it times a figure.

The measuring modules (:mod:`._peers` for the host's ceilings and other loaders,
:mod:`._tierd_io` for tierd's own paths) take a :class:`DataRun` and add rows to its report:
each load's GB/s, and beside it (``<key>_cpu``) the process CPU-seconds it cost per GB.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiering.config import TierConfig
from tiering.io import GdsConfig, GpuDirectStorage, TierIo

from ._datafiles import drop_cache
from ._measure import device_sync, gbps, timed_cpu
from ._report import BenchRow, Report, cpu_row, format_value

__all__ = ["DataRun"]


@dataclass
class DataRun:
    """Settings of one data-path run and the report its figures go to."""

    size: int
    device: str
    directory: Path
    repeats: int
    rows: int
    row_bytes: int
    cold: bool
    say: Callable[[str], None]
    report: Report
    # KvikIO's own defaults, read before any GpuDirectStorage grew its thread pool: what
    # "KvikIO out of the box" means.
    kvikio_defaults: dict[str, Any] = field(default_factory=dict)
    sync: Callable[[], None] = field(init=False)

    def __post_init__(self) -> None:
        self.sync = device_sync(self.device)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def add(self, row: BenchRow) -> BenchRow:
        """Add ``row`` to the report and say it, so a long run shows its figures as they come."""
        self.report.add(row)
        self.say(f"  {row.label}: {format_value(row.value, row.unit)} {row.note}")
        return row

    def timed(
        self, fn: Callable[[], Any], repeats: int | None = None, warmup: int = 1
    ) -> tuple[float, float]:
        """Median seconds and CPU seconds of ``fn`` (this run's repeats by default), device
        synchronised (see :func:`timed_cpu`)."""
        return timed_cpu(fn, repeats or self.repeats, warmup=warmup, sync=self.sync)

    def cold_timed(
        self, path: Path, fn: Callable[[], Any], repeats: int | None = None
    ) -> tuple[float, float]:
        """Median seconds and CPU seconds of ``fn`` with ``path`` dropped from the page cache
        before each run (the drop itself is off both clocks)."""
        times, cpus = [], []
        for _ in range(repeats or self.repeats):
            drop_cache(path)
            self.sync()
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        return statistics.median(times), statistics.median(cpus)

    def rate(
        self, key: str, label: str, nbytes: int, timing: tuple[float, float], **kw: Any
    ) -> BenchRow:
        """A GB/s row for ``nbytes`` moved in ``timing``'s seconds, and beside it its CPU cost
        (``<key>_cpu``, CPU-s/GB; see :func:`~._report.cpu_row`)."""
        seconds, cpu = timing
        row = self.add(BenchRow(key, label, gbps(nbytes, seconds), "GB/s", **kw))
        self.add(cpu_row(key, label, cpu, nbytes))
        return row

    def storage(self, io: TierIo | None = None) -> GpuDirectStorage:
        """tierd's data path onto this run's device, its directory as the (one) fast tier."""
        config = GdsConfig() if io is None else GdsConfig(fast_tier_io=io)
        return GpuDirectStorage(self.device, config, [TierConfig("bench", self.directory)])
