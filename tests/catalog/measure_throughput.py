"""Catalog write throughput of one host, PostgreSQL against SQLite (and N hosts on PostgreSQL).

Run: ``.venv/bin/python -m tests.catalog.measure_throughput [--seconds 5] [--hosts 3]``

It measures the catalog's own transactions, with no file bytes moved:

- **access flushes/s**: :meth:`Catalog.record_accesses` of a batch of 1 file, and of 256 files
  (the access tracker writes one batch per flush interval);
- **moves/s**: a move's catalog work, claim + switch + finish (three transactions), over
  distinct files, from 1 thread and from 4 (SQLite's one writer serialises them; PostgreSQL
  runs them side by side);
- **record reads/s**: :meth:`Catalog.get` from the database (PostgreSQL has no record cache);
- with ``--hosts N``: N processes, each its own host, doing moves at once on PostgreSQL.

Both catalogs are durable: SQLite with ``synchronous=FULL`` (tierd's setting), PostgreSQL with
fsync and synchronous_commit on, in temp directories on the same disk. The PostgreSQL server
is the tests' (tests/pg_support.py), started here with ``durable=True``. Figures are printed,
never asserted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.pg_support import PgServer, why_no_postgresql
from tiering.catalog import Catalog, Database, NewFile
from tiering.catalog.db import upgrade
from tiering.catalog.journal import Journal

FILES = 2048


def _files(db: Database, prefix: str) -> list[int]:
    cat = Catalog(db)
    news = [NewFile(f"{prefix}/f{i}.bin", "nvme", 1 << 20, 1, "c" * 16) for i in range(FILES)]
    return [r.id for r in cat.upsert_many(news) if r is not None]


def _rate(seconds: float, threads: int, op: Callable[[int, int], None]) -> float:
    """Operations per second of ``op(thread, n)`` run by ``threads`` threads for ``seconds``."""
    counts = [0] * threads
    stop = time.monotonic() + seconds

    def run(t: int) -> None:
        n = 0
        while time.monotonic() < stop:
            op(t, n)
            n += 1
        counts[t] = n

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    t0 = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(counts) / (time.monotonic() - t0)


def _moves(journal: Journal, ids: list[int], threads: int, seconds: float) -> float:
    # Thread t owns every threads-th file, so threads never claim the same one; each move
    # sends its file to the other tier.
    where = {r.id: r.tier for r in Catalog(journal.db).all()}

    def move(t: int, n: int) -> None:
        fid = ids[(t + n * threads) % len(ids)]
        dst = "ssd" if where[fid] == "nvme" else "nvme"
        intent, rec = journal.claim(fid, dst, reason="bench")
        out = journal.switch(intent, checksum=rec.checksum or "", size=rec.size, mtime_ns=2)
        assert out.committed
        journal.finish(intent.id)
        where[fid] = dst

    return _rate(seconds, threads, move)


def _get(cat: Catalog, file_id: int) -> None:
    cat.get(file_id)


def measure(url: str, seconds: float) -> dict[str, float]:
    upgrade(url)
    db = Database(url)
    try:
        cat, journal = Catalog(db), Journal(db)
        ids = _files(db, "bench")
        now = time.time()

        def flush(batch: int) -> Callable[[int, int], None]:
            def op(_t: int, n: int) -> None:
                start = (n * batch) % (len(ids) - batch)
                counts = {fid: 1 for fid in ids[start : start + batch]}
                cat.record_accesses(counts, now=now + n, half_life_s=86_400.0)

            return op

        figures = {
            "access_flushes_per_s_1_file": _rate(seconds, 1, flush(1)),
            "access_flushes_per_s_256_files": _rate(seconds, 1, flush(256)),
            "moves_per_s_1_thread": _moves(journal, ids, 1, seconds),
            "moves_per_s_4_threads": _moves(journal, ids[: FILES // 2], 4, seconds),
            "record_reads_per_s": _rate(seconds, 1, lambda _t, n: _get(cat, ids[n % len(ids)])),
        }
        return {k: round(v, 1) for k, v in figures.items()}
    finally:
        db.dispose()


def _host(url: str, name: str, seconds: float, start: Any, out: Any) -> None:
    db = Database(url, name=f"tierd bench {name}")
    ids = _files(db, name)
    start.wait()
    out.put(_moves(Journal(db), ids, 1, seconds))
    db.dispose()


def hosts(url: str, n: int, seconds: float) -> float:
    """Moves per second of ``n`` processes (hosts) at once, each on its own files."""
    upgrade(url)
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_host, args=(url, f"h{i}", seconds, start, out)) for i in range(n)]
    for p in procs:
        p.start()
    total = sum(out.get(timeout=seconds + 120) for _ in procs)
    for p in procs:
        p.join()
    return round(float(total), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per figure")
    parser.add_argument("--hosts", type=int, default=0, help="also N hosts on PostgreSQL")
    args = parser.parse_args()
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tierd-catalog-bench-") as tmp:
        report["sqlite"] = measure(f"sqlite:///{Path(tmp) / 'catalog.db'}", args.seconds)
    reason = why_no_postgresql()
    if reason is not None:
        report["postgresql"] = f"skipped: {reason}"
    else:
        with PgServer(durable=True) as server:
            report["postgresql"] = measure(server.url(server.create_database()), args.seconds)
            if args.hosts:
                url = server.url(server.create_database())
                report[f"postgresql_{args.hosts}_hosts_moves_per_s"] = hosts(
                    url, args.hosts, args.seconds
                )
        pg, lite = report["postgresql"], report["sqlite"]
        report["postgresql_over_sqlite"] = {k: round(pg[k] / lite[k], 2) for k in lite}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
