"""The engine's steering: the policy in force, its plan and its reasons, and the migrations it
runs, queues and records (pins included).

:class:`Steering` is the half of :class:`~tiering.engine.Engine` that decides and moves; the
other half (``tiering/engine/__init__.py``) builds the parts over one catalog, starts and stops
them, and serves content. They split here because a reader of one rarely needs the other.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, TypeVar

from tiering.catalog import Catalog, FileRecord
from tiering.catalog.journal import Journal
from tiering.copies import HostCopies
from tiering.errors import NotFound, Unavailable
from tiering.moves import Claim, MigrationInfo, Mover, Progress, RateLimiter
from tiering.placement import (
    AccessTracker,
    CurrentPolicy,
    Decision,
    PlannedMove,
    Policy,
    PolicyInfo,
    TierState,
    decision_for,
    plan,
    tier_states,
)
from tiering.tiers import Tiers

from .scheduler import PassReport, Scheduler

__all__ = ["Steering"]

_T = TypeVar("_T")


def _opened(part: _T | None) -> _T:
    """A part the engine builds in :meth:`Engine.open`, or Unavailable before then."""
    if part is None:
        raise Unavailable("the engine is not open")
    return part


class Steering:
    """Policy, plans and migrations; mixed into :class:`~tiering.engine.Engine`, which owns the
    parts named below."""

    tiers: Tiers
    limiter: RateLimiter
    access: AccessTracker | None
    host_copies: HostCopies | None
    _policy: CurrentPolicy
    _journal: Journal | None
    _mover: Mover | None
    _scheduler: Scheduler | None

    if TYPE_CHECKING:

        @property
        def catalog(self) -> Catalog: ...

    # -- policy and migrations ---------------------------------------------------------------
    @property
    def journal(self) -> Journal:
        return _opened(self._journal)

    @property
    def mover(self) -> Mover:
        return _opened(self._mover)

    @property
    def scheduler(self) -> Scheduler:
        return _opened(self._scheduler)

    def policy(self) -> Policy:
        """The policy in force."""
        return self._policy.policy

    def policy_info(self) -> PolicyInfo:
        """The policy in force with its version (0: the built-in default)."""
        return self._policy.info

    def reload_policy(self) -> PolicyInfo:
        """Pick up the newest stored policy (cheap when it did not change), and hand its
        bandwidth cap and half-life to the parts that apply them."""
        info = self._policy.reload()
        self.limiter.set_rate(info.policy.bandwidth_bytes_per_s)
        if self.access is not None:
            self.access.half_life_s = info.policy.half_life_s
        return info

    def set_policy(self, document: object, *, author: str | None = None) -> PolicyInfo:
        """Validate and store a policy document as the next version, and apply it now.

        Raises
        ------
        InvalidPolicy
            The document does not validate (nothing is stored).
        """
        self._policy.set(document, author=author)
        info = self.reload_policy()
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.wake()
        return info

    def tier_states(self) -> dict[str, TierState]:
        return tier_states(self.catalog, self.tiers)

    def plan(self, policy: Policy | None = None, now: float | None = None) -> list[PlannedMove]:
        """The moves ``policy`` (default: the one in force) would make now: a dry run."""
        policy = (policy or self.policy()).without(self.tiers.caches)  # storage tiers only
        now = time.time() if now is None else now
        origins = self.host_copies.origins if self.host_copies else ()
        return plan(self.catalog.actionable(), policy, self.tier_states(), now, origins=origins)

    def explain(
        self, file_id: int, now: float | None = None, *, scheduler: bool | None = None
    ) -> Decision:
        """Why a file is where it is: the move the policy in force makes for it now, or each
        reason it stays (the whole catalog is planned, as moves compete for room).
        ``scheduler``: whether a scheduler runs (default: this engine's).

        Raises
        ------
        FileNotFound
            No file has that id.
        """
        self.catalog.get(file_id)
        if scheduler is None:
            scheduler = self._scheduler is not None and self._scheduler.running
        return decision_for(
            file_id,
            self.catalog.actionable(),
            self.policy().without(self.tiers.caches),
            self.tier_states(),
            time.time() if now is None else now,
            in_flight={
                m.file_id: m.id for m in self.journal.open_intents() if m.file_id is not None
            },
            scheduler_on=scheduler and self.policy().enabled,
            origins=self.host_copies.origins if self.host_copies else (),
        )

    def _plan_moves(self, policy: Policy) -> list[PlannedMove]:
        self.reload_policy()
        return self.plan(policy)

    def migrate(
        self,
        file_id: int,
        to_tier: str,
        *,
        reason: str = "manual",
        progress: Progress | None = None,
    ) -> MigrationInfo:
        """Move one file now, in this thread; returns the finished migration.

        Raises
        ------
        FileBusy
            The file is migrating, pinned to another tier, or changed during the move.
        Conflict
            It is already on ``to_tier``.
        InsufficientSpace, AlreadyExists, IntegrityError, StorageError
            The move was aborted safely: the source is untouched.
        """
        self._check_move(file_id, to_tier)
        rec = self.mover.migrate(file_id, to_tier, reason=reason, progress=progress)
        return MigrationInfo(rec, rec.bytes_copied)

    def submit_move(self, file_id: int, to_tier: str, *, reason: str = "manual") -> Claim:
        """Claim a move now (so conflicts are reported at once) and queue it on the scheduler.

        Without a running scheduler the move runs in this thread before returning.
        """
        self._check_move(file_id, to_tier)
        claim = self.mover.claim(file_id, to_tier, reason=reason)
        self.scheduler.submit_or_run(claim)
        return claim

    def run_plan(self) -> PassReport:
        """Plan now and claim every planned move; they run on the scheduler's workers (or in
        this thread, one after another, without a running scheduler)."""
        self.reload_policy()
        sched = self.scheduler
        return sched.run_pass(self.policy()) if sched.running else sched.run_inline(self.plan())

    def _check_move(self, file_id: int, to_tier: str) -> None:
        self.tiers.get(to_tier)
        if self.host_copies is not None:  # a fleet's origin keeps its files
            self.host_copies.refuse_move(file_id, to_tier)

    def migration(self, intent_id: int) -> MigrationInfo:
        row = self.journal.get(intent_id)
        if row is None:
            raise NotFound(f"no migration with id {intent_id}", migration_id=intent_id)
        return MigrationInfo.of(row, self.mover)

    def claimed(self, claim: Claim) -> MigrationInfo:
        """A claimed move's migration: as the move left it when it has finished (no catalog
        read: on a busy host each read waits its turn for the cores and the GIL), else as the
        catalog has it now."""
        if claim.result is not None:
            return MigrationInfo.of(claim.result, self.mover)
        return self.migration(claim.intent.id)

    def migrations(
        self,
        *,
        phases: list[str] | None = None,
        file_id: int | None = None,
        before_id: int | None = None,
        limit: int = 100,
    ) -> list[MigrationInfo]:
        """History and in-flight migrations, newest first."""
        rows = self.journal.list(phases=phases, file_id=file_id, before_id=before_id, limit=limit)
        return [MigrationInfo.of(r, self.mover) for r in rows]

    def pin(self, file_id: int, tier: str | None = None) -> FileRecord:
        """Pin a file to ``tier`` (default: where it is now). Policy never moves a pinned file
        except to its pin; the next pass brings a file pinned elsewhere to its pin.

        Raises
        ------
        FileBusy
            The file is being migrated to another tier.
        """
        if tier is None:
            tier = self.catalog.get(file_id).tier
        self.tiers.get(tier)
        rec = self.journal.pin(file_id, tier)
        if self._scheduler is not None and self._scheduler.running and rec.tier != tier:
            self._scheduler.wake()
        return rec

    def unpin(self, file_id: int) -> FileRecord:
        return self.journal.pin(file_id, None)
