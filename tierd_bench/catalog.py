"""``tierd bench catalog``: the catalog's write throughput, SQLite against PostgreSQL, and
PostgreSQL with several hosts writing at once.

It times the catalog's own transactions, with no file bytes moved, over 2,048 files:

- **access flushes/s**: :meth:`Catalog.record_accesses` of 256 files, the batch the access
  tracker writes once per flush interval;
- **moves/s**: a move's catalog work, claim + switch + finish (three transactions), each move
  sending a file to the other tier, from 1 thread and from 4 threads on disjoint files
  (SQLite's one writer serialises them; PostgreSQL runs them side by side);
- **N hosts**: N processes, each its own host with its own files and connections, moving at
  once on one PostgreSQL; the figure is their total.

Both catalogs are durable, in temp directories on the same disk: SQLite as tierd runs it
(``synchronous=FULL``), PostgreSQL with fsync and synchronous commit on. Without a URL the bench
starts a throwaway PostgreSQL the way the tests do (:mod:`._postgres`); with one, it measures
that server in a scratch database it creates and drops (the URL's role needs CREATEDB), so an
existing catalog is never written to. Each figure is the median of ``runs`` timed runs.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tiering.catalog import Catalog, Database, NewFile, upgrade
from tiering.catalog.backends import redact
from tiering.catalog.journal import Journal

from ._postgres import PgServer, require_postgresql, scratch_database, why_no_postgresql
from ._report import BenchRow, Report

__all__ = ["CatalogBenchUnavailable", "run"]

FILES = 2048
BATCH = 256
THREADS = 4
# The target: PostgreSQL at half SQLite's rate or better, for one host.
PG_OVER_SQLITE = 0.5


class CatalogBenchUnavailable(Exception):
    """The PostgreSQL named by ``--catalog-url`` cannot be measured (why in the message)."""


def _rate(seconds: float, threads: int, op: Callable[[int, int], None]) -> float:
    """Operations per second of ``op(thread, n)`` run by ``threads`` threads for ``seconds``."""
    counts = [0] * threads
    errors: list[BaseException] = []
    stop = time.monotonic() + seconds

    def loop(t: int) -> None:
        n = 0
        try:
            while time.monotonic() < stop and not errors:
                op(t, n)
                n += 1
        except BaseException as exc:  # re-raised below: a failed figure must not read as 0/s
            errors.append(exc)
        counts[t] = n

    workers = [threading.Thread(target=loop, args=(t,), name=f"bench-{t}") for t in range(threads)]
    t0 = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return sum(counts) / (time.monotonic() - t0)


class _Host:
    """One host's catalog work on its own files: flushes and moves, timed."""

    def __init__(self, url: str, host: str) -> None:
        self.db = Database(url, name=f"tierd bench {host}", host=host)
        self.catalog, self.journal = Catalog(self.db), Journal(self.db, host=host)
        news = [NewFile(f"{host}/f{i}.bin", "nvme", 1 << 20, 1, "c" * 16) for i in range(FILES)]
        self.ids = [r.id for r in self.catalog.upsert_many(news) if r is not None]
        self.where = dict.fromkeys(self.ids, "nvme")
        self.lock = threading.Lock()
        self.clock = time.time()  # accesses are stamped later each flush, as in service

    def flushes(self, seconds: float) -> float:
        def flush(_t: int, n: int) -> None:
            start = (n * BATCH) % (len(self.ids) - BATCH)
            with self.lock:
                self.clock += 1.0
                now = self.clock
            counts = dict.fromkeys(self.ids[start : start + BATCH], 1)
            self.catalog.record_accesses(counts, now=now, half_life_s=86_400.0)

        return _rate(seconds, 1, flush)

    def moves(self, seconds: float, threads: int) -> float:
        # Thread t owns every threads-th file, so no two threads claim the same one.
        def move(t: int, n: int) -> None:
            fid = self.ids[(t + n * threads) % len(self.ids)]
            dst = "ssd" if self.where[fid] == "nvme" else "nvme"
            intent, rec = self.journal.claim(fid, dst, reason="bench")
            out = self.journal.switch(
                intent, checksum=rec.checksum or "", size=rec.size, mtime_ns=2
            )
            if not out.committed:
                raise RuntimeError(f"the switch of file {fid} did not commit")
            self.journal.finish(intent.id)
            self.where[fid] = dst

        return _rate(seconds, threads, move)

    def close(self) -> None:
        self.db.dispose()


def _one_host(url: str, seconds: float, runs: int) -> dict[str, list[float]]:
    upgrade(url)
    host = _Host(url, "bench-h0")
    try:
        out: dict[str, list[float]] = {"flush": [], "moves_1": [], f"moves_{THREADS}": []}
        for _ in range(runs):
            out["flush"].append(host.flushes(seconds))
            out["moves_1"].append(host.moves(seconds, 1))
            out[f"moves_{THREADS}"].append(host.moves(seconds, THREADS))
        return out
    finally:
        host.close()


def _host_process(url: str, index: int, seconds: float, runs: int, start: Any, out: Any) -> None:
    # A host of its own: its own process, connections, host id and files.
    try:
        host = _Host(url, f"bench-h{index + 1}")
    except BaseException:
        start.abort()  # the others would wait at the barrier for ever
        raise
    try:
        for r in range(runs):
            start.wait(timeout=seconds + 300)
            out.put((r, host.moves(seconds, 1)))
    finally:
        host.close()


def _hosts(url: str, n: int, seconds: float, runs: int) -> list[float]:
    """Each run's total moves per second of ``n`` hosts moving at once."""
    # spawn, not fork: a forked child would share the parent's connections and threads.
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=_host_process, args=(url, i, seconds, runs, start, out), daemon=True)
        for i in range(n)
    ]
    for p in procs:
        p.start()
    totals = [0.0] * runs
    deadline = time.monotonic() + 120 + runs * (seconds + 30)
    got = 0
    try:
        while got < n * runs:
            try:
                r, rate = out.get(timeout=1.0)
            except queue.Empty:
                # A host that died (at import, say) would leave the others at the barrier.
                failed = [p.exitcode for p in procs if p.exitcode]
                if failed or time.monotonic() > deadline:
                    why = f"exit codes {failed}" if failed else "no result in time"
                    raise RuntimeError(f"a host process failed: {why}") from None
                continue
            totals[r] += rate
            got += 1
    finally:
        for p in procs:
            if got < n * runs:
                p.kill()  # failed: the others may be waiting for it at the barrier
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return totals


@contextlib.contextmanager
def _postgresql(url: str | None, say: Callable[[str], None]) -> Iterator[tuple[str | None, str]]:
    """(a database URL to measure, or None, and what it is, or why there is none)."""
    if url is not None:
        with scratch_database(url) as scratch:
            yield scratch, f"{redact(url)} (a scratch database, dropped afterwards)"
        return
    reason = why_no_postgresql()
    if reason is not None:
        say(f"PostgreSQL rows skipped: {reason}")
        yield None, f"skipped: {reason}"
        return
    say("starting a throwaway PostgreSQL (durable: fsync and synchronous commit on)")
    with PgServer(durable=True) as server:
        yield server.url(server.create_database()), "throwaway server, durable, on loopback"


def run(
    seconds: float = 2.0,
    runs: int = 3,
    hosts: int = 3,
    catalog_url: str | None = None,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Measure SQLite and PostgreSQL side by side, in one run (see the module docstring).

    Parameters
    ----------
    seconds
        Length of each timed run of each figure.
    runs
        Timed runs per figure; the rows are their medians.
    hosts
        Hosts writing at once for the fleet figure (0: none).
    catalog_url
        ``postgresql+psycopg://...`` of a server to measure; default a throwaway one.

    Raises
    ------
    CatalogBenchUnavailable
        ``catalog_url`` is not PostgreSQL.
    NoScratchDatabase
        No scratch database can be created there.
    """
    if seconds <= 0 or runs < 1 or hosts < 0:
        raise ValueError("seconds must be positive, runs at least 1, hosts at least 0")
    require_postgresql(catalog_url, CatalogBenchUnavailable)
    with tempfile.TemporaryDirectory(prefix="tierd-catalog-bench-") as tmp:
        say(f"SQLite: {runs} runs of {seconds:g} s per figure")
        lite = _one_host(f"sqlite:///{Path(tmp) / 'catalog.db'}", seconds, runs)
    pg: dict[str, list[float]] | None = None
    fleet: list[float] | None = None
    with _postgresql(catalog_url, say) as (url, server):
        if url is not None:
            say(f"PostgreSQL, one host: {runs} runs of {seconds:g} s per figure")
            pg = _one_host(url, seconds, runs)
            if hosts:
                say(f"PostgreSQL, {hosts} host processes moving at once")
                fleet = _hosts(url, hosts, seconds, runs)
    return _report(lite, pg, fleet, server, seconds=seconds, runs=runs, hosts=hosts)


def _report(
    lite: dict[str, list[float]],
    pg: dict[str, list[float]] | None,
    fleet: list[float] | None,
    server: str,
    *,
    seconds: float,
    runs: int,
    hosts: int,
) -> Report:
    report = Report(
        "catalog",
        f"tierd bench catalog: {FILES:,} files, {runs} runs of {seconds:g} s, medians",
        {
            "seconds": seconds,
            "runs": runs,
            "hosts": hosts,
            "files": FILES,
            "batch": BATCH,
            "postgresql": server,
        },
    )
    skipped = "" if pg is not None else server
    figures = (
        ("flush", f"access flushes of {BATCH} files", "flushes/s"),
        ("moves_1", "moves (claim + switch + finish), 1 thread", "moves/s"),
        (f"moves_{THREADS}", f"moves, {THREADS} threads at once", "moves/s"),
    )
    for key, label, unit in figures:
        report.add(
            BenchRow(f"sqlite_{key}", f"SQLite: {label}", statistics.median(lite[key]), unit)
        )
        value = statistics.median(pg[key]) if pg is not None else None
        report.add(BenchRow(f"pg_{key}", f"PostgreSQL: {label}", value, unit, note=skipped))
        report.compare(f"pg_{key}", f"sqlite_{key}", PG_OVER_SQLITE)
    if hosts:
        row = report.add(
            BenchRow(
                f"pg_moves_{hosts}_hosts",
                f"PostgreSQL: moves, {hosts} hosts at once (total)",
                statistics.median(fleet) if fleet is not None else None,
                "moves/s",
                note=skipped,
            )
        )
        report.compare(row.key, "pg_moves_1")
        if row.ratio is not None:
            # The issue asks that the fleet's total grow with hosts: more than one host's.
            row.target, row.met = "> 1x", row.ratio > 1.0
    return report
