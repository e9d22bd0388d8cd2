"""The :class:`Mover`: the one object the engine and the scheduler drive migrations through.

It is a façade over the modules that do the work:

- :mod:`tiering.moves.steps`: the protocol of one move, steps 2-10 in
  :class:`~tiering.moves.steps.MoveRunner` (step 1 is :meth:`Mover.claim`), and :data:`STEPS`,
  the test hook's names;
- :mod:`tiering.moves.recovery`: settling the moves a crash interrupted, at start;
- :mod:`tiering.moves.concurrency`: claims, per-file guards, the rate limiter, progress;
- :mod:`tiering.moves.failures` and :mod:`tiering.moves.fsops`: errors and file operations.

File operations are called as ``os.<name>`` at call time, so tests inject faults by patching
``os`` functions; :attr:`Mover.hook` is called with each step's name (tests SIGKILL there).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from tiering.catalog import Catalog, Migration, MigrationPhase
from tiering.catalog.journal import Journal
from tiering.moves._copyproc import CopyProcess
from tiering.moves.concurrency import (
    Claim,
    FileGuards,
    Progress,
    ProgressBoard,
    RateLimiter,
    ServingGate,
)
from tiering.moves.failures import Cancelled
from tiering.moves.recovery import RecoveryReport, recover
from tiering.moves.steps import CHUNK, COPY_NICE, STEPS, MoveRunner, MoveSettings
from tiering.tiers import Tier, Tiers

# Names defined in the modules above are re-exported: the package's __init__, its files and
# history modules, tests and docs import them as ``tiering.moves.mover.<name>``.
__all__ = [
    "STEPS",
    "Cancelled",
    "Claim",
    "FileGuards",
    "Mover",
    "Progress",
    "RateLimiter",
    "RecoveryReport",
    "ServingGate",
]


class Mover:
    """Runs migrations and recovers the ones a crash interrupted.

    Parameters
    ----------
    catalog, journal, tiers:
        The engine's catalog, migration journal and tiers.
    guards:
        Shared with uploads and deletes (see :class:`FileGuards`).
    limiter:
        The bandwidth cap shared by all migrations.
    room:
        Bytes that may still be placed on a tier (free space capped by its quota).
    chunk_size:
        Bytes per read/write of the copy.
    copy_nice:
        Nice levels below the process for the thread that copies (see
        :meth:`~tiering.moves.steps.MoveRunner._copy`); 0 copies in the move's thread.
    """

    def __init__(
        self,
        catalog: Catalog,
        journal: Journal,
        tiers: Tiers,
        *,
        guards: FileGuards | None = None,
        limiter: RateLimiter | None = None,
        room: Callable[[Tier], int] | None = None,
        chunk_size: int = CHUNK,
        copy_nice: int = COPY_NICE,
    ) -> None:
        self.catalog = catalog
        self.journal = journal
        self.tiers = tiers
        self.guards = guards or FileGuards()
        self.limiter = limiter or RateLimiter()
        #: Where moves yield to serving: the engine touches it as it serves each request.
        self.gate = ServingGate()
        # One settings object shared with the runner: ``room``, ``chunk_size`` and ``hook``
        # below are views of it, so a change made here is seen by a move at its next step.
        self.settings = MoveSettings(
            room=room or (lambda tier: tier.space().free),
            chunk_size=chunk_size,
            copy_nice=copy_nice,
        )
        self._board = ProgressBoard()
        self._runner = MoveRunner(
            catalog,
            journal,
            tiers,
            limiter=self.limiter,
            gate=self.gate,
            board=self._board,
            settings=self.settings,
        )

    # -- knobs (views of ``settings``) -------------------------------------------------------
    @property
    def room(self) -> Callable[[Tier], int]:
        """Bytes that may still be placed on a tier; asked at step 2 of each move."""
        return self.settings.room

    @room.setter
    def room(self, value: Callable[[Tier], int]) -> None:
        self.settings.room = value

    @property
    def chunk_size(self) -> int:
        """Bytes per read/write of the copy."""
        return self.settings.chunk_size

    @chunk_size.setter
    def chunk_size(self, value: int) -> None:
        self.settings.chunk_size = value

    @property
    def copy_nice(self) -> int:
        """Nice levels below the process for the thread that copies; 0: the move's thread."""
        return self.settings.copy_nice

    @copy_nice.setter
    def copy_nice(self, value: int) -> None:
        self.settings.copy_nice = value

    @property
    def hook(self) -> Callable[[str], None] | None:
        """Test-only: called with each step's name (see STEPS)."""
        return self.settings.hook

    @hook.setter
    def hook(self, value: Callable[[str], None] | None) -> None:
        self.settings.hook = value

    def progress(self) -> dict[int, int]:
        """Bytes copied so far per in-flight intent id."""
        return self._board.snapshot()

    # -- one move ----------------------------------------------------------------------------
    def claim(
        self,
        file_id: int,
        dst_tier: str,
        *,
        reason: str,
        expected_generation: int | None = None,
    ) -> Claim:
        """Step 1. Raises FileBusy, Conflict, FileNotFound or TierNotFound; nothing changes."""
        self.tiers.get(dst_tier)
        self.guards.acquire(file_id)
        try:
            intent, rec = self.journal.claim(
                file_id, dst_tier, reason=reason, expected_generation=expected_generation
            )
        except BaseException:
            self.guards.release(file_id)
            raise
        self.settings.at("claimed")
        return Claim(intent, rec)

    def abandon(self, claim: Claim, why: str) -> None:
        """Release a claim that never started copying."""
        try:
            self.journal.release(claim.intent, phase=MigrationPhase.ABORTED, error=why)
        finally:
            self.guards.release(claim.record.id)
            claim.error = Cancelled(why)
            claim.done.set()

    def migrate(
        self,
        file_id: int,
        dst_tier: str,
        *,
        reason: str = "manual",
        expected_generation: int | None = None,
        progress: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> Migration:
        """Claim and run one move in this thread; returns the finished intent."""
        claim = self.claim(
            file_id, dst_tier, reason=reason, expected_generation=expected_generation
        )
        return self.run(claim, progress=progress, cancel=cancel)

    def run(
        self,
        claim: Claim,
        *,
        progress: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> Migration:
        """Steps 2-10 of a claimed move.

        Raises
        ------
        InsufficientSpace, AlreadyExists, IntegrityError, FileBusy, StorageError, Cancelled
            The move was aborted: the source is untouched and authoritative, nothing is left at
            the destination, and the intent records the error.
        """
        try:
            result = self._runner.run(claim, progress, cancel)
        except BaseException as exc:
            claim.error = exc
            raise
        else:
            claim.result = result
            return result
        finally:
            # Whatever happened, the claim ends here: waiters on ``done`` see result or error.
            self._board.pop(claim.intent.id)
            self.guards.release(claim.record.id)
            claim.done.set()
            if claim.owed_rest_s > 0:  # this mover thread yields to serving, the file free
                self.gate.rest(claim.owed_rest_s, cancel)

    @property
    def copy_process(self) -> CopyProcess:
        """The process that copies large moves' bytes (see :mod:`tiering.moves._copyproc`)."""
        return self._runner.copier.process

    def close(self) -> None:
        """Stop the copy process, if one was started (the engine's stop calls it)."""
        self._runner.copier.close()

    # -- recovery ----------------------------------------------------------------------------
    def recover(self) -> RecoveryReport:
        """Settle every intent a crash left open; run before serving. Idempotent.

        ``copying``: the source is authoritative; ``switched``: B is. When one side is gone
        and the other holds verified bytes, that side is kept. Anything else is quarantined
        and nothing is deleted. The full rule is in :mod:`tiering.moves.recovery`.
        """
        return recover(self.catalog, self.journal, self.tiers)
