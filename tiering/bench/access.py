"""Benchmark of the access-ingest path: how many accesses a second tierd can count, and whether
counting slows reads. Run with ``python -m tiering.bench.access`` (or as part of ``tierd bench``).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tiering.config import EngineConfig, TierConfig
from tiering.engine import Engine

__all__ = ["measure_access_ingest"]


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
    files: int = 10_000, accesses: int = 1_000_000, reads: int = 2_000, repeats: int = 3
) -> dict[str, Any]:
    """Measure, on this host, in one run:

    - ``record_per_s``: accesses counted per second by one thread (median of ``repeats``);
    - ``record_per_s_2threads``: the same with two threads recording at once;
    - ``flush_files_per_s``: distinct files written to the catalog per second in one flush;
    - ``end_to_end_per_s``: accesses per second counted *and* flushed to the catalog;
    - ``read_p50_us`` / ``read_p99_us``: a 4 KiB read through the engine, idle and while
      another thread records 100,000 accesses a second with the flusher running.
    """
    with tempfile.TemporaryDirectory(prefix="tierd-access-bench-") as tmp:
        root = Path(tmp)
        config = EngineConfig(
            tiers=(TierConfig("fast", root / "fast"),),
            catalog_url=f"sqlite:///{root / 'catalog.db'}",
            access_flush_interval_s=0.05,
        )
        for i in range(files):
            p = root / "fast" / f"d{i % 100}" / f"f{i}"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(os.urandom(4096) if i < 100 else b"")
        with Engine(config) as engine:
            tracker = engine.access
            assert tracker is not None
            ids = [r.id for r in engine.catalog.all()]
            read_ids = ids[:100]

            def record_n(n: int) -> None:
                rec = tracker.record
                k = len(ids)
                for i in range(n):
                    rec(ids[i % k])

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
                record_n(len(ids))
                t0 = time.perf_counter()
                tracker.flush()
                flush.append(len(ids) / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                record_n(accesses)
                tracker.flush()
                e2e.append(accesses / (time.perf_counter() - t0))
                tracker.start()

            idle = _read_latencies_us(engine, read_ids, reads)
            stop = threading.Event()

            def ingest_at_target_rate() -> None:
                # 100,000 accesses/s (the target rate), in 1,000-access bursts every 10 ms.
                next_at = time.perf_counter()
                while not stop.is_set():
                    record_n(1_000)
                    next_at += 0.01
                    stop.wait(max(0.0, next_at - time.perf_counter()))

            h = threading.Thread(target=ingest_at_target_rate, name="access-ingest")
            h.start()
            try:
                busy = _read_latencies_us(engine, read_ids, reads)
            finally:
                stop.set()
                h.join()

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

    return {
        "files": files,
        "accesses": accesses,
        "record_per_s": statistics.median(single),
        "record_per_s_2threads": statistics.median(double),
        "flush_files_per_s": statistics.median(flush),
        "end_to_end_per_s": statistics.median(e2e),
        "read_p50_us_idle": pct(idle, 0.5),
        "read_p99_us_idle": pct(idle, 0.99),
        "read_p50_us_while_ingesting": pct(busy, 0.5),
        "read_p99_us_while_ingesting": pct(busy, 0.99),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(measure_access_ingest(), indent=2))
