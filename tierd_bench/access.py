"""``tierd bench access``: how many accesses a second tierd can count, and whether counting
slows reads.

Every access of a file is counted in memory and flushed to the catalog in batches by a
background thread; this measures both halves and a read through the engine meanwhile.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiering.config import EngineConfig, TierConfig
from tiering.engine import Engine

from ._measure import percentile
from ._report import BenchRow, Report

__all__ = ["measure_access_ingest"]

# The ingest rate tierd is built for; reads are measured again while it is being recorded.
TARGET_PER_S = 100_000


def _read_latencies_us(engine: Engine, file_ids: list[int], n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        content = engine.open_content(file_ids[i % len(file_ids)])
        for _ in content.iter_range(0, content.size):
            pass
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def measure_access_ingest(
    files: int = 10_000,
    accesses: int = 1_000_000,
    reads: int = 2_000,
    repeats: int = 3,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Measure, on this host, in one run, into a catalog of ``files`` files:

    - ``record_per_s``: accesses counted per second by one thread (median of ``repeats``);
    - ``record_per_s_2threads``: the same with two threads recording at once;
    - ``flush_files_per_s``: distinct files written to the catalog per second in one flush;
    - ``end_to_end_per_s``: accesses per second counted *and* flushed to the catalog;
    - ``read_p50_us_idle`` / ``read_p99_us_idle``: ``reads`` 4 KiB reads through the engine;
    - ``read_p50_us_while_ingesting`` / ``read_p99_..``: the same while another thread records
      100,000 accesses a second with the flusher running.
    """
    if files < 1 or accesses < 2 or reads < 1 or repeats < 1:
        raise ValueError("files, reads and repeats must be at least 1, accesses at least 2")
    with tempfile.TemporaryDirectory(prefix="tierd-access-bench-") as tmp:
        root = Path(tmp)
        config = EngineConfig(
            tiers=(TierConfig("fast", root / "fast"),),
            catalog_url=f"sqlite:///{root / 'catalog.db'}",
            access_flush_interval_s=0.05,
        )
        say(f"writing {files:,} files and counting accesses into their catalog")
        _write_files(root / "fast", files)
        with Engine(config) as engine:
            tracker = engine.access
            assert tracker is not None
            ids = [r.id for r in engine.catalog.all()]
            record_n = _recorder(tracker.record, ids)
            rates = _rates(tracker, record_n, len(ids), accesses, repeats)
            say(f"{reads:,} 4 KiB reads, idle and while recording {TARGET_PER_S:,} accesses/s")
            idle, busy = _reads(engine, ids[:100], reads, record_n)
    return _report(files, accesses, reads, repeats, rates, idle, busy)


def _write_files(root: Path, files: int) -> None:
    for i in range(files):
        p = root / f"d{i % 100}" / f"f{i}"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(4096) if i < 100 else b"")


def _recorder(rec: Callable[[int], object], ids: list[int]) -> Callable[[int], None]:
    """A function that counts ``n`` accesses, round the files ``ids``."""

    def record_n(n: int) -> None:
        k = len(ids)
        for i in range(n):
            rec(ids[i % k])

    return record_n


def _rates(
    tracker: Any, record_n: Callable[[int], None], nfiles: int, accesses: int, repeats: int
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per repeat: accesses counted a second by one thread and by two, files flushed a
    second, and accesses counted and flushed a second."""
    single, double, flush, e2e = [], [], [], []
    for _ in range(repeats):
        tracker.flush()
        t0 = time.perf_counter()
        record_n(accesses)
        single.append(accesses / (time.perf_counter() - t0))

        threads = [threading.Thread(target=record_n, args=(accesses // 2,)) for _ in "ab"]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        double.append(accesses / (time.perf_counter() - t0))

        tracker.stop()  # measure flushes alone, without the background thread
        record_n(nfiles)
        t0 = time.perf_counter()
        tracker.flush()
        flush.append(nfiles / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        record_n(accesses)
        tracker.flush()
        e2e.append(accesses / (time.perf_counter() - t0))
        tracker.start()
    return single, double, flush, e2e


def _reads(
    engine: Engine, read_ids: list[int], reads: int, record_n: Callable[[int], None]
) -> tuple[list[float], list[float]]:
    """Read latencies, idle and while another thread records ``TARGET_PER_S`` accesses."""
    # Untimed first: the first reads open files and warm caches, and would otherwise
    # be charged to "idle" alone.
    _read_latencies_us(engine, read_ids, min(reads, 100))
    idle = _read_latencies_us(engine, read_ids, reads)
    stop = threading.Event()

    def ingest_at_target_rate() -> None:
        # The target rate, in bursts every 10 ms.
        next_at = time.perf_counter()
        while not stop.is_set():
            record_n(TARGET_PER_S // 100)
            next_at += 0.01
            stop.wait(max(0.0, next_at - time.perf_counter()))

    h = threading.Thread(target=ingest_at_target_rate, name="access-ingest")
    h.start()
    try:
        busy = _read_latencies_us(engine, read_ids, reads)
    finally:
        stop.set()
        h.join()
    return idle, busy


def _report(
    files: int,
    accesses: int,
    reads: int,
    repeats: int,
    rates: tuple[list[float], list[float], list[float], list[float]],
    idle: list[float],
    busy: list[float],
) -> Report:
    single, double, flush, e2e = rates
    report = Report(
        "access",
        f"tierd bench access: {files:,} files, {accesses:,} accesses a run, medians of {repeats}",
        {"files": files, "accesses": accesses, "reads": reads, "repeats": repeats},
    )
    add = report.add
    add(BenchRow("record_per_s", "accesses counted, 1 thread", statistics.median(single), "/s"))
    add(
        BenchRow(
            "record_per_s_2threads",
            "accesses counted, 2 threads at once",
            statistics.median(double),
            "/s",
        )
    )
    add(
        BenchRow(
            "flush_files_per_s",
            "files written to the catalog in one flush",
            statistics.median(flush),
            "files/s",
        )
    )
    e2e_rate = statistics.median(e2e)
    add(
        BenchRow(
            "end_to_end_per_s",
            "accesses counted and flushed, end to end",
            e2e_rate,
            "/s",
            target=f">= {TARGET_PER_S:,} /s",
            met=e2e_rate >= TARGET_PER_S,
        )
    )
    busy_label = f"while recording {TARGET_PER_S:,}/s"
    for q in (50, 99):
        add(
            BenchRow(
                f"read_p{q}_us_idle",
                f"4 KiB read through the engine, idle, p{q}",
                percentile(idle, q),
                "us",
            )
        )
        add(
            BenchRow(
                f"read_p{q}_us_while_ingesting",
                f"4 KiB read through the engine, {busy_label}, p{q}",
                percentile(busy, q),
                "us",
            )
        )
        report.compare(f"read_p{q}_us_while_ingesting", f"read_p{q}_us_idle")
    report.compare("record_per_s_2threads", "record_per_s")
    return report
