"""The migration scheduler: a background thread that plans, then runs the moves.

It is the engine's (placement decides; the engine owns the threads that act on its decisions).

Every ``interval_s`` (and whenever asked) it reloads the policy, asks the planner for moves when
nothing is in flight, claims them and runs them on worker threads, at most ``concurrency`` at a
time; the shared :class:`~tiering.moves.mover.RateLimiter` caps their bandwidth together. ``stop()``
abandons copies in progress at the next chunk (each abort is clean: the source stays, the temp
goes), lets a move past its copy finish, releases queued claims and joins every thread.

While the catalog's database cannot be reached (:class:`~tiering.errors.CatalogUnreachable`) a
pass stops at its first read, before it claims anything, so nothing is half-claimed and the
memory tier's pass it would wake does not run either; the next pass is the probe that finds the
database back. The pause is logged once when it starts and once when it ends, not every pass.

Once the database answers after an outage, the next pass first settles the intents the outage
left open (:func:`~tiering.moves.recovery.settle`: only those no live move holds), as
start-up recovery would, and the database wakes the scheduler for it at once. Every pass also
verifies this host's lock (:meth:`~tiering.catalog.db.Database.check_host_lock`): a PostgreSQL
restart drops it; when another tierd with this host id took it meanwhile, moves stop for good
(:attr:`Scheduler.paused` says why) and the catalog refuses this process's writes.

A move that failed because a tier did not answer (:class:`~tiering.errors.Unavailable`: an
object store down) is aborted cleanly by the mover; the scheduler then plans that file again
only after a backoff that doubles with each failure (from the pass interval to
:data:`MAX_BACKOFF_S`), so a dead store is not hammered every pass, and a success clears it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tiering.errors import (
    CatalogUnreachable,
    Conflict,
    FileBusy,
    FileNotFound,
    HostLockLost,
    TierdError,
    Unavailable,
)
from tiering.moves import Claim, Mover, RecoveryReport
from tiering.moves.recovery import settle
from tiering.placement.policy import PlannedMove, Policy

__all__ = ["PassReport", "Scheduler"]

log = logging.getLogger(__name__)

#: The longest wait before a move that failed on an unreachable tier is planned again.
MAX_BACKOFF_S = 3600.0


@dataclass
class PassReport:
    """What one planning pass did."""

    started_at: float
    planned: int = 0
    claimed: list[Claim] = field(default_factory=list)
    skipped: list[tuple[PlannedMove, str]] = field(default_factory=list)


class Scheduler:
    """Owns the scheduler thread and the migration workers.

    Parameters
    ----------
    mover:
        Runs each claimed move.
    policy:
        Returns the policy in force (reloaded from the catalog when it changed).
    planner:
        Returns the moves the policy wants now.
    caches:
        Each called after each planning pass: the caches' planners (the memory tier's, the
        fleet's copies on this host's tiers) run then, on their own threads (their fills do not
        hold up the moves).
    """

    def __init__(
        self,
        mover: Mover,
        policy: Callable[[], Policy],
        planner: Callable[[Policy], list[PlannedMove]],
        caches: Sequence[Callable[[], None]] = (),
    ) -> None:
        self.mover = mover
        self._policy = policy
        self._planner = planner
        self._caches = list(caches)
        self._queue: deque[Claim] = deque()
        self._running: dict[int, threading.Thread] = {}  # slots in use
        self._threads: list[threading.Thread] = []  # every worker not yet joined
        self._cv = threading.Condition()
        self._stopped = threading.Event()
        self._cancel = threading.Event()
        self._wake = False
        self._thread: threading.Thread | None = None
        self.passes = 0
        self.last_pass: PassReport | None = None
        #: Why passes are paused (the catalog is unreachable), or None.
        self.paused: str | None = None
        #: What the last settling after an outage did (None: none ran yet).
        self.last_settle: RecoveryReport | None = None
        self._settled = 0  # the database's outage count the last settle (or start) covered
        mover.catalog.db.on_back(self.wake)
        # file id -> (failures in a row, monotonic time before which it is not planned again)
        self._backoff: dict[int, tuple[int, float]] = {}

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopped.clear()
        self._cancel.clear()
        self._settled = self.mover.catalog.db.outages  # start-up recovery settled those
        self._thread = threading.Thread(target=self._loop, name="tierd-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Abandon copies in progress safely, release queued claims, join every thread."""
        self._stopped.set()
        self._cancel.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._drain()

    def wake(self) -> None:
        """Run a planning pass now (and pick up a changed interval)."""
        with self._cv:
            self._wake = True
            self._cv.notify_all()

    def submit(self, claim: Claim) -> None:
        """Queue a claimed move; it runs when a worker slot is free."""
        with self._cv:
            if self._stopped.is_set() or self._thread is None:
                self.mover.abandon(claim, "the scheduler is not running")
                return
            self._queue.append(claim)
            self._cv.notify_all()

    def busy(self) -> bool:
        with self._cv:
            return bool(self._queue or self._running)

    def run_pass(self, policy: Policy | None = None) -> PassReport:
        """Plan and claim; the claims go to the queue (or run nowhere when stopped)."""
        policy = policy or self._policy()
        report = PassReport(started_at=time.time())
        moves = self._planner(policy)
        report.planned = len(moves)
        for move in moves:
            wait = self._backoff.get(move.file_id)
            if wait is not None and time.monotonic() < wait[1]:
                report.skipped.append((move, f"retried after {wait[0]} failed attempt(s)"))
                continue
            try:
                claim = self.mover.claim(move.file_id, move.dst, reason=move.reason)
            except CatalogUnreachable:
                raise  # the others would fail alike: stop the pass (see the module docstring)
            except TierdError as exc:
                report.skipped.append((move, exc.message))
                continue
            report.claimed.append(claim)
            self.submit(claim)
        for wake in self._caches:
            wake()
        self.passes += 1
        self.last_pass = report
        return report

    def run_inline(self, moves: list[PlannedMove]) -> PassReport:
        """Claim and run ``moves`` one after another in this thread (no scheduler running)."""
        report = PassReport(started_at=time.time(), planned=len(moves))
        for move in moves:
            try:
                claim = self.mover.claim(move.file_id, move.dst, reason=move.reason)
            except (FileBusy, FileNotFound, Conflict) as exc:
                report.skipped.append((move, exc.message))
                continue
            report.claimed.append(claim)
            self.submit_or_run(claim)
        return report

    def submit_or_run(self, claim: Claim) -> None:
        """Queue ``claim`` when the scheduler runs, else run it now in this thread (a failure
        is recorded on the claim and in the journal)."""
        if self.running:
            self.submit(claim)
            return
        with contextlib.suppress(Exception):
            self.mover.run(claim)

    # -- the thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        next_pass = time.monotonic() + self._interval()
        owed = False  # a wake that came while moves ran: its pass runs when they end
        while not self._stopped.is_set():
            with self._cv:
                self._dispatch()
                timeout = next_pass - time.monotonic()
                if timeout > 0 and not self._wake:
                    self._cv.wait(timeout)
                    self._dispatch()
                woken, self._wake = self._wake, False
            if self._stopped.is_set():
                break
            if woken or owed or time.monotonic() >= next_pass:
                next_pass = time.monotonic() + self._interval()
                try:
                    self._check_host()
                    policy = self._policy()
                    if policy.enabled and self.busy():
                        # Kept, not dropped: a pin arriving while the last moves finish would
                        # otherwise wait a whole interval. A worker's end notifies this loop.
                        owed = owed or woken
                    elif policy.enabled:
                        owed = False
                        self.run_pass(policy)
                    self._resume()
                except CatalogUnreachable as exc:
                    self._pause(exc.message)
                except Exception:
                    log.exception("scheduler pass failed; will retry")

    def _check_host(self) -> None:
        """Verify this host's lock, then settle what an outage since the last check left open.

        Raises
        ------
        CatalogUnreachable
            The database does not answer (settling waits for the next pass).
        HostLockLost
            Another tierd with this host id took the lock.
        """
        db = self.mover.catalog.db
        if not db.check_host_lock():
            raise HostLockLost(db.fenced or "this host's lock was lost")
        outages = db.outages
        if outages == self._settled:
            return
        m = self.mover
        report = settle(m.catalog, m.journal, m.tiers, m.guards)
        self._settled = outages
        self.last_settle = report
        if report.changed:
            log.warning("after the catalog outage: %s", report)

    def _pause(self, why: str) -> None:
        if self.paused is None:
            log.warning("moves paused until the catalog answers again: %s", why)
        self.paused = why

    def _resume(self) -> None:
        if self.paused is not None:
            log.warning("the catalog answers again: moves resume")
        self.paused = None

    def _interval(self) -> float:
        try:
            return self._policy().interval_s
        except Exception:
            return 60.0

    def _dispatch(self) -> None:
        """Start queued moves while there are free slots (called holding the condition)."""
        self._threads = [t for t in self._threads if t.is_alive()]
        try:
            limit = self._policy().concurrency
        except Exception:
            limit = 1
        while self._queue and len(self._running) < limit and not self._stopped.is_set():
            claim = self._queue.popleft()
            t = threading.Thread(
                target=self._work,
                args=(claim,),
                name=f"tierd-move-{claim.intent.id}",
                daemon=True,
            )
            self._running[claim.intent.id] = t
            self._threads.append(t)
            t.start()

    def _work(self, claim: Claim) -> None:
        fid = claim.record.id
        try:
            self.mover.run(claim, cancel=self._cancel)
            self._backoff.pop(fid, None)
        except Unavailable as exc:
            n = self._backoff.get(fid, (0, 0.0))[0] + 1
            delay = min(MAX_BACKOFF_S, self._interval() * 2**n)
            self._backoff[fid] = (n, time.monotonic() + delay)
            log.warning(
                "migration %d did not complete: %s; retried in %.1f s",
                claim.intent.id,
                exc.message,
                delay,
            )
        except TierdError as exc:
            log.warning("migration %d did not complete: %s", claim.intent.id, exc.message)
        except Exception:
            log.exception("migration %d failed", claim.intent.id)
        finally:
            with self._cv:
                self._running.pop(claim.intent.id, None)
                self._cv.notify_all()

    def _drain(self) -> None:
        with self._cv:
            running = list(self._threads)
            self._threads.clear()
            queued = list(self._queue)
            self._queue.clear()
        for t in running:
            t.join()
        for claim in queued:
            try:
                self.mover.abandon(claim, "the engine stopped before this move started")
            except Exception:
                log.exception("could not release migration %d; recovery will", claim.intent.id)
