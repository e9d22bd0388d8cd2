"""The migration scheduler: a background thread that plans, then runs the moves.

Every ``interval_s`` (and whenever asked) it reloads the policy, asks the planner for moves when
nothing is in flight, claims them and runs them on worker threads, at most ``concurrency`` at a
time; the shared :class:`~tiering.moves.mover.RateLimiter` caps their bandwidth together. ``stop()``
abandons copies in progress at the next chunk (each abort is clean: the source stays, the temp
goes), lets a move past its copy finish, releases queued claims and joins every thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tiering.errors import TierdError
from tiering.moves import Claim, Mover
from tiering.placement.policy import PlannedMove, Policy

__all__ = ["PassReport", "Scheduler"]

log = logging.getLogger(__name__)


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
    cache:
        Called after each planning pass: the memory tier's planner runs then, on its own
        thread (its fills do not hold up the moves).
    """

    def __init__(
        self,
        mover: Mover,
        policy: Callable[[], Policy],
        planner: Callable[[Policy], list[PlannedMove]],
        cache: Callable[[], None] | None = None,
    ) -> None:
        self.mover = mover
        self._policy = policy
        self._planner = planner
        self._cache = cache
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

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopped.clear()
        self._cancel.clear()
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
            try:
                claim = self.mover.claim(move.file_id, move.dst, reason=move.reason)
            except TierdError as exc:
                report.skipped.append((move, exc.message))
                continue
            report.claimed.append(claim)
            self.submit(claim)
        if self._cache is not None:
            self._cache()
        self.passes += 1
        self.last_pass = report
        return report

    # -- the thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        next_pass = time.monotonic() + self._interval()
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
            if woken or time.monotonic() >= next_pass:
                next_pass = time.monotonic() + self._interval()
                try:
                    policy = self._policy()
                    if policy.enabled and not self.busy():
                        self.run_pass(policy)
                except Exception:
                    log.exception("scheduler pass failed; will retry")

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
        try:
            self.mover.run(claim, cancel=self._cancel)
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
