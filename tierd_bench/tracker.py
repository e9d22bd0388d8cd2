"""``tierd bench tracker``: the fleet's tracker, its PostgreSQL catalog, under N hosts filling
one model at once, with no byte moved.

A fleet distribution's bookkeeping is the catalog's: one piece map per file generation (its
digests, read by every receiver) and one holding row per host (a bitmap of the pieces it has
verified, grown as each lands, read by every receiver to plan its next pieces). Each simulated
host makes exactly the catalog calls a real fill makes (:mod:`tiering.copies.piecefill`), at
the rate its link allows: it lands a piece every ``piece_size / link`` seconds
(told to the catalog in batches, :meth:`~tiering.catalog.pieces.Pieces.mark`, as a fill
tells what it took from peers) and reads every holding every
:data:`~tiering.copies.piecefill.POLL_S` (:meth:`~tiering.catalog.pieces.Pieces.holdings`),
and the map until it is final (:meth:`~tiering.catalog.pieces.Pieces.map`). Hosts are
threads, spread over worker processes with their own connections.

Per fleet size it reports the piece events per second the catalog took against those the
hosts asked for, the p50/p99 of a landing and of a planning read, PostgreSQL's CPU (its
processes on this machine, from /proc) and WAL bytes, and the rollout time the tracker alone
would allow: the fill's piece events over the rate it took, against the link's time for the
model. Where the client processes are the bottleneck (a 2-core machine runs out of cores
before PostgreSQL does), the figures say so: read them as a floor.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._postgres import PgServer, require_postgresql, scratch_database, why_no_postgresql
from ._report import BenchRow, Report

__all__ = ["TrackerBenchUnavailable", "run"]

GiB = 1 << 30


class TrackerBenchUnavailable(Exception):
    """No PostgreSQL to measure (why in the message)."""


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _host(
    url: str, file_id: int, generation: int, count: int, host: str, pps: float, seconds: float
) -> dict[str, Any]:
    """One host's fill, simulated in its thread: its landings and planning reads, timed."""
    from tiering.catalog import Database
    from tiering.catalog.pieces import Pieces
    from tiering.copies.piecefill import MARK_EVERY, MARK_S, POLL_S

    db = Database(url, host=host)
    pieces = Pieces(db)
    order = list(range(count))
    random.Random(host).shuffle(order)
    lands: list[float] = []
    reads: list[float] = []
    t0 = time.monotonic()
    stop, next_land, next_poll, i = t0 + seconds, t0, t0, 0
    done = marked_at = t0
    m = None
    marked = landed = 0
    try:
        while i < count:
            now = time.monotonic()
            if now >= stop:
                break
            if now >= next_poll:
                t = time.perf_counter()
                if m is None or not m.final:  # a fill reads a final map once (piecefill)
                    m = pieces.map(file_id, generation)
                pieces.holdings(file_id, generation)
                reads.append(time.perf_counter() - t)
                next_poll += POLL_S
            if now >= next_land:
                # A piece from a peer: told to the catalog in a batch (piecefill's MARK_S,
                # MARK_EVERY), so a landing costs a transaction only when a batch is due.
                i += 1
                next_land += 1 / pps
                done = time.monotonic()
                if i - marked >= MARK_EVERY or done - marked_at >= MARK_S or i == count:
                    t = time.perf_counter()
                    pieces.mark(file_id, host=host, generation=generation, verified=order[marked:i])
                    lands.append(time.perf_counter() - t)
                    landed += i - marked
                    marked, marked_at = i, time.monotonic()
            wait = min(next_land, next_poll, stop) - time.monotonic()
            if wait > 0:
                time.sleep(wait)
    finally:
        db.dispose()
    return {"lands": lands, "landed": landed, "reads": reads, "elapsed": done - t0}


def _worker(args: tuple[Any, ...], out: Any) -> None:
    url, file_id, generation, count, hosts, pps, seconds = args
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one(h: str) -> None:
        r = _host(url, file_id, generation, count, h, pps, seconds)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one, args=(h,)) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(results)


def _postgres_cpu() -> float:
    """CPU seconds of the postgres processes on this machine (a bench's own server, here)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        if name != "postgres":
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        # Its own and its reaped children's: a backend that exited (its host's connections
        # closed) is counted in the postmaster's cutime/cstime.
        total += sum(int(f) for f in fields[11:15]) / tick
    return total


def _model(url: str, size: int, piece_size: int) -> tuple[int, int, int]:
    """The model's record on a shared tier and its final piece map; (file id, generation,
    pieces)."""
    from tiering.catalog import Catalog, Database, NewFile
    from tiering.catalog.piecemaps import WIDTH, piece_count
    from tiering.catalog.pieces import Pieces
    from tiering.checksum import ALGORITHM

    db = Database(url, host="origin", shared_tiers=["s3"])
    try:
        rec = Catalog(db).upsert(
            NewFile("model/weights.safetensors", "s3", size, 1, f"{ALGORITHM}:0", "etag")
        )
        assert rec is not None
        count = piece_count(size, piece_size)
        Pieces(db).record_map(
            rec.id,
            generation=rec.generation,
            size=size,
            piece_size=piece_size,
            algorithm=ALGORITHM,
            digests=[bytes(WIDTH[ALGORITHM])] * count,
            host="origin",
        )
        return rec.id, rec.generation, count
    finally:
        db.dispose()


def _wal(url: str) -> int:
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    e = create_engine(url, poolclass=NullPool)
    try:
        with e.connect() as c:
            lsn = c.execute(text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).scalar()
            return int(lsn or 0)
    finally:
        e.dispose()


def _fleet(
    report: Report,
    server_url: str,
    n: int,
    size: int,
    piece_size: int,
    link: float,
    seconds: float,
    workers: int,
    say: Callable[[str], None],
) -> None:
    from tiering.catalog import upgrade

    with scratch_database(server_url) as url:
        upgrade(url)
        file_id, generation, count = _model(url, size, piece_size)
        pps = link / piece_size
        say(f"{n} hosts: {count} pieces each, {pps:.0f} landings/s a host, {seconds:g} s")
        hosts = [f"host-{i:04d}" for i in range(n)]
        per = max(1, -(-n // workers))
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        cpu0, wal0, t0 = _postgres_cpu(), _wal(url), time.monotonic()
        procs = [
            ctx.Process(
                target=_worker,
                args=((url, file_id, generation, count, hosts[i : i + per], pps, seconds), out),
            )
            for i in range(0, n, per)
        ]
        for p in procs:
            p.start()
        results = [r for _ in procs for r in out.get(timeout=seconds * 4 + 120)]
        for p in procs:
            p.join()
        wall = time.monotonic() - t0
        cpu, wal = _postgres_cpu() - cpu0, _wal(url) - wal0
    lands = [x for r in results for x in r["lands"]]
    reads = [x for r in results for x in r["reads"]]
    # Pieces the catalog recorded, over the time the hosts landed (a small model is filled
    # before the run's end); each catalog write (a batch) is timed as a landing.
    took = sum(r["landed"] for r in results) / max(r["elapsed"] for r in results)
    asked = n * pps
    k = f"n{n}"
    note = f"asked {asked:,.0f}/s ({took / asked:.0%})"
    report.add(BenchRow(f"{k}_events", f"{n} hosts: piece events/s taken", took, "/s", note=note))
    for name, xs in (("land", lands), ("read", reads)):
        p50, p99 = _pct(xs, 0.5), _pct(xs, 0.99)
        ms = None if p50 is None else p50 * 1e3
        report.add(BenchRow(f"{k}_{name}_p50", f"  {name} p50", ms, "ms"))
        report.add(
            BenchRow(
                f"{k}_{name}_p99",
                f"  {name} p99",
                None if p99 is None else p99 * 1e3,
                "ms",
                target="< 50" if name == "read" else None,
                met=None if p99 is None or name != "read" else p99 < 0.05,
            )
        )
    report.add(BenchRow(f"{k}_pg_cpu", "  PostgreSQL CPU", cpu / wall, "cores"))
    report.add(BenchRow(f"{k}_wal", "  WAL written", wal / wall / 1e6, "MB/s"))
    ideal = size / link
    tracker = n * count / took if took else float("inf")
    report.add(
        BenchRow(
            f"{k}_rollout",
            "  rollout the tracker allows, x the link's time",
            tracker / ideal,
            "x",
            target="<= 1.1",
            met=tracker <= 1.1 * ideal,
            note=f"{tracker:.1f} s against {ideal:.1f} s",
        )
    )


def run(
    hosts: Sequence[int] = (10, 100),
    size: int = 16 * GiB,
    *,
    link: float = 2e9,
    seconds: float = 5.0,
    workers: int | None = None,
    catalog_url: str | None = None,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Measure the tracker for each fleet size of ``hosts`` (see the module)."""
    from tiering.fleet.pieces import PIECE_SIZE

    if catalog_url is not None:
        require_postgresql(catalog_url, TrackerBenchUnavailable)
    elif (why := why_no_postgresql()) is not None:
        raise TrackerBenchUnavailable(why)
    workers = workers or max(1, min(os.cpu_count() or 1, 8))
    setup = {"hosts": list(hosts), "size_bytes": size, "piece_size": PIECE_SIZE}
    setup |= {"link_bytes_per_s": link, "seconds": seconds, "workers": workers}
    report = Report(
        "tracker",
        f"tierd bench tracker: {size / GiB:g} GiB model, {PIECE_SIZE >> 20} MiB pieces, "
        f"{link / 1e9:g} GB/s a host, {seconds:g} s per fleet, {workers} client processes",
        setup,
    )
    with PgServer() if catalog_url is None else _Given(catalog_url) as server:
        base = server.url("postgres") if catalog_url is None else catalog_url
        for n in hosts:
            _fleet(report, base, n, size, PIECE_SIZE, link, seconds, workers, say)
    return report


class _Given:
    """A server given by URL, used as :class:`PgServer` is."""

    def __init__(self, url: str) -> None:
        self._url = url

    def __enter__(self) -> _Given:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def url(self, dbname: str) -> str:
        return self._url
