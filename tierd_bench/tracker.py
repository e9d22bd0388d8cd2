"""``tierd bench tracker``: the fleet's tracker, its PostgreSQL catalog, under N hosts filling
one model at once, with no byte moved.

A fleet distribution's bookkeeping is the catalog's: one piece map per file generation (its
digests, read once by every receiver) and one holding row per host (a bitmap of the pieces it
has verified). Each simulated host makes exactly the catalog calls a real fill makes
(:mod:`tiering.copies.piecefill`), through the same class
(:class:`~tiering.fleet.peerwindow.PeerWindow`): at its start the map, a read of the most
complete holdings and a claim on the bucket (no claimer is live when a distribution starts),
then a poll every :attr:`~tiering.fleet.peerwindow.PeerWindow.interval` (its holding written
with the pieces landed since the last, and the next window of peers' holdings read), and a last
flush. Pieces land at the rate its link allows while the host is not waiting on the tracker (a
fill's loop starts no fetch while it polls). Hosts are scheduled on a few threads per client
process sharing one connection pool, as a PgBouncer shares a server's connections among a fleet.

Per fleet size it reports the piece events per second taken against those the hosts asked for,
the polls, their p50/p99, how late the clients started them (their lag: when it is large the
clients, not the tracker, were the bound), PostgreSQL's CPU (its own server's processes, from
/proc) and WAL bytes, the clients' CPU, the share of the fills' time spent waiting on the
tracker, and the rollout time the tracker alone would allow against the link's time for the
model; where the clients could not poll as often as asked, that row says its figure is not the
tracker's.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ._postgres import PgServer, require_postgresql, scratch_database, why_no_postgresql
from ._report import Report
from ._trackerrows import Fleet, fleet_rows
from ._trackersim import worker

__all__ = ["TrackerBenchUnavailable", "run"]

GiB = 1 << 30
#: Threads a client process runs its hosts' calls on (each host's calls are one after another,
#: as a fill's are; more threads than this only queue on the GIL).
THREADS = 12


class TrackerBenchUnavailable(Exception):
    """No PostgreSQL to measure (why in the message)."""


def _postgres_cpu(root: int | None) -> float:
    """CPU seconds of the PostgreSQL server whose postmaster is ``root`` (the bench's own:
    other servers on the machine, tests' for one, are not counted), 0 without one."""
    if root is None:
        return 0.0
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(d.name) != root and int(fields[1]) != root:
            continue
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
    pid: int | None,
    n: int,
    size: int,
    piece_size: int,
    link: float,
    seconds: float,
    workers: int,
    polls_per_s: float,
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
        threads = min(per, THREADS)
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        cpu0, wal0, t0 = _postgres_cpu(pid), _wal(url), time.monotonic()
        procs = [
            ctx.Process(
                target=worker,
                args=(
                    (
                        url,
                        file_id,
                        generation,
                        count,
                        hosts[i : i + per],
                        pps,
                        seconds,
                        threads,
                        polls_per_s,
                    ),
                    out,
                ),
            )
            for i in range(0, n, per)
        ]
        for p in procs:
            p.start()
        results = [out.get(timeout=seconds * 4 + 120) for _ in procs]
        for p in procs:
            p.join()
        wall = time.monotonic() - t0
        cpu, wal = _postgres_cpu(pid) - cpu0, _wal(url) - wal0
    fleet_rows(report, Fleet(n, count, pps, polls_per_s), results, wall, cpu, wal)


def run(
    hosts: Sequence[int] = (10, 100),
    size: int = 16 * GiB,
    *,
    link: float = 2e9,
    seconds: float = 5.0,
    workers: int | None = None,
    polls_per_s: float | None = None,
    catalog_url: str | None = None,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Measure the tracker for each fleet size of ``hosts`` (see the module), the hosts'
    polls held to ``polls_per_s`` together (default: the ``fleet_tracker_polls`` setting's)."""
    from tiering.fleet.peerwindow import POLLS_PER_S
    from tiering.fleet.pieces import PIECE_SIZE

    polls_per_s = polls_per_s or POLLS_PER_S

    if catalog_url is not None:
        require_postgresql(catalog_url, TrackerBenchUnavailable)
    elif (why := why_no_postgresql()) is not None:
        raise TrackerBenchUnavailable(why)
    workers = workers or max(1, min(os.cpu_count() or 1, 8))
    setup = {"hosts": list(hosts), "size_bytes": size, "piece_size": PIECE_SIZE}
    setup |= {"link_bytes_per_s": link, "seconds": seconds, "workers": workers}
    setup |= {"tracker_polls": polls_per_s}
    report = Report(
        "tracker",
        f"tierd bench tracker: {size / GiB:g} GiB model, {PIECE_SIZE >> 20} MiB pieces, "
        f"{link / 1e9:g} GB/s a host, {seconds:g} s per fleet, {workers} client processes, "
        f"polls held to {polls_per_s:,.0f}/s",
        setup,
    )
    with PgServer() if catalog_url is None else _Given(catalog_url) as server:
        base = server.url("postgres") if catalog_url is None else catalog_url
        for n in hosts:
            proc = server.proc if isinstance(server, PgServer) else None
            pid = None if proc is None else proc.pid
            _fleet(report, base, pid, n, size, PIECE_SIZE, link, seconds, workers, polls_per_s, say)
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
