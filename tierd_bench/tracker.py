"""``tierd bench tracker``: the fleet's tracker, its PostgreSQL catalog, under N hosts filling
one model at once, with no byte moved.

A fleet distribution's bookkeeping is the catalog's: one piece map per file generation (its
digests, read once by every receiver) and one holding row per host (a bitmap of the pieces it
has verified). Each simulated host makes exactly the catalog calls a real fill makes
(:mod:`tiering.copies.piecefill`), through the same class
(:class:`~tiering.fleet.peerwindow.PeerWindow`): at its start the map, a read of every holding
and a claim on the bucket (no claimer is live when a distribution starts), then a poll every
:attr:`~tiering.fleet.peerwindow.PeerWindow.interval` (its holding written with the pieces
landed since the last, and the next window of peers' holdings read), and a last flush. Pieces
land at the rate its link allows while the host is not waiting on the tracker (a fill's loop
starts no fetch while it polls). Hosts are scheduled on a few threads per client process sharing one
connection pool, as a PgBouncer shares a server's connections among a fleet.

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
#: Threads a client process runs its hosts' calls on (each host's calls are one after another,
#: as a fill's are; more threads than this only queue on the GIL, and on the writer pool's 15
#: connections).
THREADS = 12


class TrackerBenchUnavailable(Exception):
    """No PostgreSQL to measure (why in the message)."""


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class _Host:
    """One simulated host's fill: pieces land at the link's rate while the fill is not waiting
    on the tracker (a fill's loop starts no fetch while it polls), and every
    :attr:`~tiering.fleet.peerwindow.PeerWindow.interval` it polls through a
    :class:`~tiering.fleet.peerwindow.PeerWindow`, as a fill does."""

    def __init__(self, window: Any, count: int, pps: float, t0: float) -> None:
        self.w, self.count, self.pps, self.t0 = window, count, pps, t0
        self.order = list(range(count))
        random.Random(window.host).shuffle(self.order)
        self.told = 0
        self.blocked = 0.0
        self.elapsed = 0.0
        self.polls: list[float] = []
        self.began: list[float] = []  # when each poll began, from the fleet's start

    def start(self, pieces: Any, file_id: int, generation: int) -> None:
        """What a fill does first: read the (final) map, read every host's holding before
        claiming the bucket (no claimer is live at a distribution's start), try the claim."""
        pieces.map(file_id, generation)
        self.w.refresh(time.time(), wide=True, lacked=lambda: set(self.order))
        pieces.claim_origin(file_id, host=self.w.host, generation=generation, readers=1, ttl_s=10.0)

    def step(self, now: float) -> bool:
        """One poll (the last: the fill's final flush); True when the fill is done."""
        landed = min(self.count, int((now - self.t0 - self.blocked) * self.pps))
        if landed > self.told:
            self.w.landed(self.order[self.told : landed])
            self.told = landed
        if self.told == self.count:
            self.w.flush()
            return True
        self.w.poll()
        return False


def _worker(args: tuple[Any, ...], out: Any) -> None:
    """Simulate ``hosts`` on ``threads`` threads sharing one connection pool (as a PgBouncer
    shares a server's connections among a fleet's hosts), each host's calls timed."""
    import heapq
    import resource

    from tiering.catalog import Database
    from tiering.catalog.pieces import Pieces
    from tiering.fleet.peerwindow import POLL_S, PeerWindow

    url, file_id, generation, count, hosts, pps, seconds, threads, polls_per_s = args
    # A connection a thread, kept: a host polls on its own pooled connections, and a pool
    # smaller than the threads opened a connection for 2.7% of polls (777 sessions for 28,419
    # polls at 1,000 hosts), the p99 of the polls.
    db = Database(url, host=hosts[0], readers=threads)
    pieces = Pieces(db)
    t0 = time.monotonic()
    sims = [
        _Host(
            PeerWindow(pieces, file_id, generation, h, count=count, polls_per_s=polls_per_s),
            count,
            pps,
            t0,
        )
        for h in hosts
    ]
    # Hosts start within one poll of each other, and poll each on its own clock.
    heap = [(t0 + POLL_S * i / len(hosts), i, True) for i in range(len(hosts))]
    lock = threading.Lock()
    late: list[float] = []
    stop = t0 + seconds

    def run() -> None:
        while True:
            with lock:
                if not heap:
                    return
                due, i, first = heapq.heappop(heap)
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            sim = sims[i]
            begin = time.monotonic()
            if begin >= stop:
                sim.elapsed = begin - t0
                continue
            if first:
                sim.start(pieces, file_id, generation)
                done = False
            else:
                done = sim.step(begin)
            end = time.monotonic()
            sim.blocked += end - begin
            late.append(begin - due)
            if not first:
                sim.polls.append(end - begin)
                sim.began.append(begin - t0)
            if done:
                sim.elapsed = end - t0
                continue
            with lock:
                heapq.heappush(heap, (max(begin + sim.w.interval, end), i, False))

    pool = [threading.Thread(target=run) for _ in range(threads)]
    use0 = resource.getrusage(resource.RUSAGE_SELF)  # the simulation's, not the imports'
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    db.dispose()
    use = resource.getrusage(resource.RUSAGE_SELF)
    out.put(
        {
            "hosts": [
                {
                    "told": h.told,
                    "elapsed": h.elapsed,
                    "blocked": h.blocked,
                    "polls": h.polls,
                    "began": h.began,
                    "interval": h.w.interval,
                }
                for h in sims
            ],
            "late": late,
            "cpu": use.ru_utime + use.ru_stime - use0.ru_utime - use0.ru_stime,
        }
    )


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
                target=_worker,
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
    _rows(report, n, count, pps, polls_per_s, results, wall, cpu, wal)


def _latencies(
    report: Report, k: str, polls: list[float], steady: list[float], late: list[float]
) -> None:
    """The p50/p99 rows of the polls (all, and those after the fleet's first second) and of
    the clients' lag."""
    for key, label, xs, target in (
        ("read", "poll", polls, 0.05),
        ("steady", "poll after the fleet's first second", steady, None),
        ("late", "poll started late (the clients' lag)", late, None),
    ):
        p50, p99 = _pct(xs, 0.5), _pct(xs, 0.99)
        report.add(
            BenchRow(f"{k}_{key}_p50", f"  {label} p50", None if p50 is None else p50 * 1e3, "ms")
        )
        report.add(
            BenchRow(
                f"{k}_{key}_p99",
                f"  {label} p99",
                None if p99 is None else p99 * 1e3,
                "ms",
                target=None if target is None else f"< {target * 1e3:g}",
                met=None if p99 is None or target is None else p99 < target,
            )
        )


def _rows(
    report: Report,
    n: int,
    count: int,
    pps: float,
    budget: float,
    results: list[dict[str, Any]],
    wall: float,
    cpu: float,
    wal: int,
) -> None:
    """One fleet's rows, from its client processes' results."""
    from tiering.fleet.peerwindow import POLL_S

    sims = [h for r in results for h in r["hosts"]]
    polls = [x for h in sims for x in h["polls"]]
    # The fleet's start (every host reads the map and every holding, and claims) is a burst;
    # the polls after its first second show the tracker as a rollout goes on.
    steady = [x for h in sims for x, b in zip(h["polls"], h["began"], strict=True) if b >= 1.0]
    late = [x for r in results for x in r["late"]]
    elapsed = sum(h["elapsed"] for h in sims)
    # Pieces the hosts landed (told the catalog) over the time they ran: a fill's loop starts
    # no fetch while it waits on the tracker, so the share of its time spent waiting is the
    # share of its link the tracker takes.
    took = sum(h["told"] / h["elapsed"] for h in sims if h["elapsed"] > 0)
    blocked = sum(h["blocked"] for h in sims) / elapsed if elapsed else 1.0
    asked = n * pps
    k = f"n{n}"
    note = f"asked {asked:,.0f}/s ({took / asked:.0%})"
    report.add(BenchRow(f"{k}_events", f"{n} hosts: piece events/s taken", took, "/s", note=note))
    # Each host polls every PeerWindow.interval, which grows with the hosts it has seen filling
    # (the fleet's polls held to the budget): asked, the polls a second at the intervals the
    # hosts ended with.
    asked_polls = sum(1 / h["interval"] for h in sims)
    interval = _pct([h["interval"] for h in sims], 0.5) or POLL_S
    polled = len(polls) / (elapsed / n) if elapsed else 0.0
    note = f"asked {asked_polls:,.0f}/s ({polled / asked_polls:.0%})"
    report.add(BenchRow(f"{k}_polls", "  polls/s (one transaction each)", polled, "/s", note=note))
    report.add(
        BenchRow(
            f"{k}_interval",
            "  a host's poll interval (median)",
            interval * 1e3,
            "ms",
            note=f"{POLL_S * 1e3:g} ms up to {budget * POLL_S:,.0f} hosts filling, then "
            f"hosts / {budget:,.0f} a second",
        )
    )
    _latencies(report, k, polls, steady, late)
    # A server given by URL is not this machine's to measure.
    pg = cpu / wall if cpu else None
    report.add(BenchRow(f"{k}_pg_cpu", "  PostgreSQL CPU", pg, "cores"))
    # What sizes a fleet's PostgreSQL: its CPU a poll (the fleet's start, a few calls a host,
    # counted in), and so the hosts one core of it serves at a poll every POLL_S.
    per = cpu / len(polls) if cpu and polls else None
    report.add(
        BenchRow(
            f"{k}_pg_per_poll",
            "  PostgreSQL CPU a poll",
            None if per is None else per * 1e3,
            "ms",
            note=""
            if per is None
            else f"{POLL_S / per:,.0f} hosts a core at a poll every {POLL_S:g} s",
        )
    )
    clients = sum(r["cpu"] for r in results) / wall
    report.add(BenchRow(f"{k}_client_cpu", "  the simulated hosts' CPU", clients, "cores"))
    report.add(BenchRow(f"{k}_wal", "  WAL written", wal / wall / 1e6, "MB/s"))
    report.add(BenchRow(f"{k}_blocked", "  fills' time waiting on the tracker", blocked, "x"))
    ideal = count / pps
    # The fills' time stretched by their waits on the tracker, plus a poll interval: peers
    # learn of a host's last pieces up to a poll after they landed.
    tracker = n * count / took + interval if took else float("inf")
    lagged = polled < 0.9 * asked_polls
    report.add(
        BenchRow(
            f"{k}_rollout",
            "  rollout the tracker allows, x the link's time",
            tracker / ideal,
            "x",
            target="<= 1.1",
            # Clients that could not poll as often as asked put less load on the tracker
            # than a fleet would: then the figure is not the tracker's (met: None).
            met=None if lagged else tracker <= 1.1 * ideal,
            note=f"{tracker:.1f} s against {ideal:.1f} s"
            + (
                f"; clients polled {polled / asked_polls:.0%} of asked: not measured"
                if lagged
                else ""
            ),
        )
    )


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
