"""One run of the object-store bench: its settings, its source object, how a figure is timed,
and how every result's bytes are checked against the source.

Every figure is the median of ``repeats`` timed runs after a warm-up. Each run's result (a
file, a buffer in host or GPU memory, an object) is hashed with xxh3-128 after the clock has
stopped and compared with the source's checksum: a result with other bytes stops the bench
with :class:`BytesMismatch`, never a figure.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tiering.checksum import Hasher, hash_fd

from ._measure import MiB, device_sync, gbps
from ._origin import Origin
from ._report import BenchRow, Report, format_value

__all__ = [
    "CONNECTIONS",
    "PART",
    "SWEEP",
    "BytesMismatch",
    "ObjRun",
    "check_bytes",
    "checksum_of_array",
    "checksum_of_file",
    "cpu_of",
    "fsync_path",
    "write_source",
]

T = TypeVar("T")

#: Requests in flight of the peers (ranged GETs by hand, obstore, KvikIO's pool) unless the run
#: names its own (``--connections``), and the size of one ranged GET.
CONNECTIONS, PART = 64, 8 * MiB
#: boto3 TransferConfigs tried when the run names no connection count: (max_concurrency,
#: chunk MiB). A run that names one tries that concurrency with each chunk size.
SWEEP = tuple((c, m) for c in (16, 64) for m in (8, 16, 64))


class BytesMismatch(AssertionError):
    """A result's bytes differ from the source's: the figure it came with means nothing."""


def check_bytes(what: str, got: str, expected: str) -> None:
    """Raise :class:`BytesMismatch` unless checksum ``got`` is ``expected``."""
    if got != expected:
        raise BytesMismatch(f"{what}: the bytes differ from the source ({got} != {expected})")


def write_source(path: Path, size: int, seed: int = 17) -> str:
    """``size`` bytes of random data, every MiB stamped with its index (so parts put at the
    wrong offset change the checksum); fsynced. Returns its checksum."""
    block = np.random.default_rng(seed).integers(0, 256, size=min(size, 64 * MiB), dtype=np.uint8)
    h = Hasher()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < size:
            n = min(block.size, size - done)
            chunk = block[:n].copy()
            for mib in range(0, n, MiB):
                stamp = np.frombuffer(((done + mib) // MiB).to_bytes(8, "little"), np.uint8)
                chunk[mib : mib + min(8, n - mib)] = stamp[: min(8, n - mib)]
            h.update(chunk.data)
            done += os.pwrite(fd, chunk.data, done)
        os.fsync(fd)
    finally:
        os.close(fd)
    return h.value()


def checksum_of_file(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return hash_fd(fd)
    finally:
        os.close(fd)


def checksum_of_array(arr: Any, nbytes: int | None = None) -> str:
    """Checksum of the first ``nbytes`` of a flat uint8 NumPy or CuPy array (or any buffer)."""
    if hasattr(arr, "device") and not isinstance(arr, np.ndarray):  # CuPy: copy to host
        arr = arr.get()
    view = np.asarray(arr, dtype=np.uint8).reshape(-1).data
    h = Hasher()
    h.update(view[: len(view) if nbytes is None else nbytes])
    return h.value()


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` has used, from
    ``/proc/<pid>/stat``: how the bench counts a server's CPU beside its own."""
    with open(f"/proc/{pid}/stat") as f:
        # The command name (field 2) may hold spaces: count fields after its closing paren.
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class ObjRun:
    """Settings of one object-store run and the report its figures go to."""

    origin: Origin
    size: int
    device: str
    repeats: int
    work: Path
    source: Path
    expected: str
    say: Callable[[str], None]
    report: Report
    #: The object every transfer reads: ``<prefix>/model.bin``.
    prefix: str
    #: ``--connections``: the s3 tier's connections and the peers' requests in flight; None
    #: keeps the tier's defaults, :data:`CONNECTIONS` for the peers and the :data:`SWEEP`.
    connections: int | None = None
    #: 4 KiB reads per latency figure.
    samples: int = 200
    sync: Callable[[], None] = field(init=False)

    def __post_init__(self) -> None:
        self.sync = device_sync(self.device)

    def on(self, device: str) -> ObjRun:
        """This run, measuring loads into ``device`` (the same origin, object and report)."""
        return replace(self, device=device)

    @property
    def conns(self) -> int:
        """Requests in flight of every peer."""
        return self.connections or CONNECTIONS

    @property
    def sweep(self) -> tuple[tuple[int, int], ...]:
        if self.connections is None:
            return SWEEP
        return tuple((self.connections, m) for m in (8, 16, 64))

    @property
    def dev(self) -> str:
        """``cuda`` or ``cpu``: the suffix of this device's row keys."""
        return "cuda" if self.cuda else "cpu"

    @property
    def key(self) -> str:
        return f"{self.prefix}/model.bin"

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def add(self, row: BenchRow) -> BenchRow:
        """Add ``row`` to the report and say it, so a long run shows its figures as they come."""
        self.report.add(row)
        self.say(f"  {row.label}: {format_value(row.value, row.unit)} {row.note}")
        return row

    def missing(self, key: str, label: str, why: str, unit: str = "GB/s") -> None:
        """A row for a figure that could not be taken here, with the reason."""
        self.add(BenchRow(key, label, None, unit, note=why))

    def check(self, what: str, got: str) -> None:
        check_bytes(what, got, self.expected)

    def timed(
        self,
        fn: Callable[[], T],
        check: Callable[[T], None],
        *,
        repeats: int | None = None,
        warmup: int = 1,
        before: Callable[[], None] | None = None,
        cpu_clock: Callable[[], float] = time.process_time,
    ) -> tuple[float, float]:
        """(median seconds, median CPU seconds) of ``fn`` over ``repeats`` runs after ``warmup``
        runs; ``before()`` and ``check(result)`` run before and after each run, off the clock.
        CPU seconds are this process's unless ``cpu_clock`` counts more (a server's too)."""
        times, cpus = [], []
        for i in range(warmup + (repeats or self.repeats)):
            if before is not None:
                before()
            self.sync()
            c0, t0 = cpu_clock(), time.perf_counter()
            result = fn()
            self.sync()
            t, c = time.perf_counter() - t0, cpu_clock() - c0
            check(result)
            del result
            if i >= warmup:
                times.append(t)
                cpus.append(c)
        return statistics.median(times), statistics.median(cpus)

    def rate_row(
        self,
        key: str,
        label: str,
        seconds: float,
        cpu: float | None = None,
        note: str = "",
        *,
        whose: str = "",
    ) -> BenchRow:
        """A GB/s row for moving this run's ``size`` bytes in ``seconds``; ``cpu`` seconds go
        in the note as CPU-s/GB (``whose``: which processes they count, when not just this)."""
        if cpu is not None:
            whose = f", {whose}" if whose else ""
            note = f"{note} ({cpu / (self.size / 1e9):.2f} CPU-s/GB{whose})".strip()
        return self.add(BenchRow(key, label, gbps(self.size, seconds), "GB/s", note=note))
