"""``tierd bench tracker``'s simulated hosts (see :mod:`tierd_bench.tracker`): each makes the
catalog calls a real fill makes, through the class a fill polls with, as its link lets pieces
land; a client process runs a share of the fleet on a few threads."""

from __future__ import annotations

import heapq
import random
import threading
import time
from typing import Any

__all__ = ["worker"]


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
        """What a fill does first: read the (final) map, read the most complete holdings (and
        count the hosts filling) before claiming the bucket (no claimer is live at a
        distribution's start), try the claim."""
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


class _Fleet:
    """The simulated hosts of one client process, each polling on its own clock (hosts start
    within one poll of each other); :meth:`run` on several threads takes the next host due."""

    def __init__(
        self, sims: list[_Host], pieces: Any, file_id: int, generation: int, t0: float, stop: float
    ) -> None:
        from tiering.fleet.peerwindow import POLL_S

        self.sims, self.pieces, self.file_id, self.generation = sims, pieces, file_id, generation
        self.t0, self.stop = t0, stop
        self.heap = [(t0 + POLL_S * i / len(sims), i, True) for i in range(len(sims))]
        self.lock = threading.Lock()
        self.late: list[float] = []

    def run(self) -> None:
        while True:
            with self.lock:
                if not self.heap:
                    return
                due, i, first = heapq.heappop(self.heap)
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            if (after := self._turn(self.sims[i], due, first)) is not None:
                with self.lock:
                    heapq.heappush(self.heap, (after, i, False))

    def _turn(self, sim: _Host, due: float, first: bool) -> float | None:
        """One call of ``sim``'s (its start, or a poll); when its next is due (None: done)."""
        begin = time.monotonic()
        if begin >= self.stop:
            sim.elapsed = begin - self.t0
            return None
        if first:
            sim.start(self.pieces, self.file_id, self.generation)
            done = False
        else:
            done = sim.step(begin)
        end = time.monotonic()
        landed_at = self.t0 + sim.blocked + sim.count / sim.pps  # the last piece, at the most
        sim.blocked += end - begin
        self.late.append(begin - due)
        if not first:
            sim.polls.append(end - begin)
            sim.began.append(begin - self.t0)
        if done:
            # A fill tells its last pieces as soon as they land (its final flush), not at the
            # next poll: the simulation finds it done up to an interval after that.
            sim.elapsed = min(end, landed_at + (end - begin)) - self.t0
            return None
        interval: float = sim.w.interval
        return max(begin + interval, end)


def worker(args: tuple[Any, ...], out: Any) -> None:
    """Simulate ``hosts`` on ``threads`` threads sharing one connection pool (as a PgBouncer
    shares a server's connections among a fleet's hosts), each host's calls timed."""
    import resource

    from tiering.catalog import Database
    from tiering.catalog.pieces import Pieces
    from tiering.fleet.peerwindow import PeerWindow

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
    fleet = _Fleet(sims, pieces, file_id, generation, t0, t0 + seconds)
    pool = [threading.Thread(target=fleet.run) for _ in range(threads)]
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
            "late": fleet.late,
            "cpu": use.ru_utime + use.ru_stime - use0.ru_utime - use0.ru_stime,
        }
    )
