"""The engine: owns the tiers, the catalog and the background threads, and offers the file
operations the service and the CLI are built on.

It is a façade. Each job lives in the room of its concern: reads, uploads, deletes and
migrations in :mod:`tiering.moves`, the policy in force and each tier's room in
:mod:`tiering.placement`, scan and the watcher in :mod:`tiering.sync`, the catalog and its lock
in :mod:`tiering.catalog`. The engine builds them over one catalog, starts them in the order that
keeps a crash's leftovers from being served, and stops them in reverse.
"""

from __future__ import annotations

import logging
import time
from types import TracebackType

from tiering.catalog import Catalog, CatalogLock, Copies, Database, FileRecord, decay, upgrade
from tiering.catalog.journal import Journal
from tiering.catalog.policies import PolicyStore
from tiering.config import EngineConfig
from tiering.copies import HostCopies, MemoryCache
from tiering.errors import FileNotFound, NotFound, Unavailable
from tiering.fleet import Heartbeat, adopt_local_records, host_database
from tiering.moves import (
    Claim,
    Content,
    FileGuards,
    FileOps,
    MigrationInfo,
    Mover,
    Progress,
    RateLimiter,
    RecoveryReport,
    Upload,
    remove_orphan_temps,
)
from tiering.placement import (
    AccessTracker,
    CurrentPolicy,
    Decision,
    PassReport,
    PlannedMove,
    Policy,
    PolicyInfo,
    Scheduler,
    TierInfo,
    TierState,
    decide,
    plan,
    room,
    tier_infos,
    tier_states,
)
from tiering.sync import ScanReport, TierWatcher, scan
from tiering.tiers import Tier, Tiers
from tiering.tiers.paths import validate_relpath

# The views and handles the service builds on are re-exported here, so callers import the
# engine's API from one place whichever room defines each piece.
__all__ = ["Content", "Engine", "MigrationInfo", "PolicyInfo", "TierInfo", "Upload"]

log = logging.getLogger(__name__)


class Engine:
    """tierd's engine over one set of tiers and one catalog. ``start()`` brings the schema up
    to date, recovers, scans and starts the background threads; ``stop()`` stops them and
    flushes. Use it as a context manager."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        memory = config.memory
        self.tiers = Tiers(config.tiers, caches=[memory.name] if memory is not None else [])
        if config.default_tier is not None:
            self.tiers.get(config.default_tier)
        self.db: Database | None = None
        self._catalog: Catalog | None = None
        self.access: AccessTracker | None = None
        # Keyed by host on PostgreSQL: hosts share its catalog, one tierd each.
        self._lock = CatalogLock(config.catalog_url, host_id=config.host_id)
        self.started_at: float | None = None
        self.last_scan: ScanReport | None = None
        self.last_recovery: RecoveryReport | None = None
        # Shared by the mover, uploads and deletes (see FileGuards), and by every migration.
        self.guards = FileGuards()
        self.limiter = RateLimiter()
        self._journal: Journal | None = None
        self._mover: Mover | None = None
        self._files: FileOps | None = None
        self._scheduler: Scheduler | None = None
        self.watcher: TierWatcher | None = None
        # Built now: heat and quotas are asked for before the catalog opens (default until then).
        self._policy = CurrentPolicy(
            config.tier_names(),
            half_life_s=config.half_life_s,
            memory=memory.name if memory is not None else None,
        )
        #: Copies of hot files in pinned host memory (a cache above the tiers), or None.
        self.memory = MemoryCache.build(config, policy=self.policy, limiter=self.limiter)
        #: This host's copies of a fleet's shared (origin) files on its own tiers, or None.
        self.host_copies: HostCopies | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            raise Unavailable("the engine is not open")
        return self._catalog

    def open(self, *, upgrade_schema: bool = True) -> Engine:
        """Check the tiers (a directory root is created; a bucket must answer and take a
        write), upgrade the schema and connect; no threads, no scan.

        Raises :class:`~tiering.errors.TierUnavailable` naming the tier and why it is unusable.
        """
        for tier in self.tiers:
            tier.check()
        if self.memory is not None:
            self.memory.tier.check()  # its quota against RLIMIT_MEMLOCK and the host's RAM
        if upgrade_schema:
            upgrade(self.config.catalog_url)
        self.db = host_database(self.config, self.tiers)
        self._catalog = Catalog(self.db)
        self.access = AccessTracker(
            self._catalog,
            half_life_s=self.config.half_life_s,
            interval_s=self.config.access_flush_interval_s,
        )
        self._journal = Journal(self.db, host=self.config.host_id)
        self._policy.store = PolicyStore(self.db)
        self._mover = Mover(
            self._catalog,
            self._journal,
            self.tiers,
            guards=self.guards,
            limiter=self.limiter,
            room=lambda tier: self._room(tier, replacing=None),
        )
        self._files = FileOps(
            self._catalog,
            self.tiers,
            guards=self.guards,
            room=self._room,
            default_tier=self.config.default_tier,
            max_upload_bytes=self.config.max_upload_bytes,
        )
        if self.memory is not None:
            self.memory.open(self._catalog, Copies(self.db), self._files)
        self.host_copies = HostCopies.build(
            self.db, self._catalog, self._files, self.tiers,
            policy=self.policy, quota=self._policy.quota, limiter=self.limiter, config=self.config,
        )  # fmt: skip
        wakes = [c.wake for c in (self.memory, self.host_copies) if c is not None]
        self._scheduler = Scheduler(self._mover, self.policy, self._plan_moves, wakes)
        self.reload_policy()
        return self

    def start(self, *, scheduler: bool = True) -> Engine:
        """Open exclusively (one serving process per catalog), then, before serving: recover
        interrupted migrations, remove orphan temp files, scan; then start the threads.

        Recovery comes first: it decides what each open intent's files are, so the temp cleanup
        and the scan that follow see settled state. ``scheduler=False``: policy moves are the
        caller's (the CLI runs them in the foreground).
        """
        self._lock.acquire()
        try:
            self.open().catalog.db.serve_under(self._lock)  # verified after each outage
            adopt_local_records(self.catalog.db, self.tiers, self.config.host_id)  # before recovery
            self.last_recovery = self.mover.recover()
            remove_orphan_temps(self.journal, self.tiers)
            if self.host_copies is not None:
                self.host_copies.start()  # reconciled with its rows before serving
            if self.memory is not None:
                self.memory.start(keep_locations=[t.name for t in self.tiers])
            if self.config.watch:
                # Watch before scanning, so nothing changed during the scan goes unseen.
                self.watcher = TierWatcher(
                    self.catalog,
                    self.tiers,
                    settle_s=self.config.watch_settle_s,
                    backend=self.config.watch_backend,
                    poll_interval_s=self.config.watch_poll_interval_s,
                    reconcile_files_per_s=self.config.reconcile_files_per_s,
                    remote_reconcile_s=self.config.remote_reconcile_s,
                )
                self.watcher.start()
            if self.config.scan_on_start:
                self.last_scan = scan(self.catalog, self.tiers)
            assert self.access is not None
            self.access.start()
            self.heartbeat = Heartbeat.start_for(self.catalog.db, self.tiers, self.config)  # fleet
            if scheduler:
                assert self._scheduler is not None
                self._scheduler.start()
        except BaseException:
            self.stop()
            raise
        self.started_at = time.time()
        return self

    def stop(self) -> None:
        # Watcher first (it writes the catalog), then moves, then the last access counts.
        for attr, what in (
            ("watcher", "stopping the file watcher"),
            ("_scheduler", "stopping the migration scheduler"),
            ("host_copies", "stopping the host's copies"),
            ("access", "the final flush of access counts"),
            ("heartbeat", "stopping the heartbeat"),
        ):
            part = getattr(self, attr, None)  # the heartbeat is set only once started
            if part is None:
                continue
            try:
                part.stop()
            except Exception:
                log.exception("%s failed", what)
            setattr(self, attr, None)
        if self.memory is not None:
            self.memory.stop()  # before the catalog closes: its copies' rows go too
        if self.db is not None:
            self.db.dispose()
            self.db = None
            self._catalog = None
            self._files = None
        self.tiers.close()  # an object tier's connections and transfer threads
        self._lock.release()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- queries -----------------------------------------------------------------------------
    def heat(self, record: FileRecord, now: float | None = None) -> float:
        """The record's heat decayed to ``now`` with the policy's half-life."""
        now = time.time() if now is None else now
        return decay(record.heat, record.heat_at, now, self._policy.policy.half_life_s)

    def tier_infos(self) -> list[TierInfo]:
        return tier_infos(self.catalog, self.tiers)

    def get(self, file_id: int) -> FileRecord:
        return self.catalog.get(file_id)

    def lookup(self, relpath: str, *, cached: bool = False) -> FileRecord:
        return self.catalog.lookup(validate_relpath(relpath), cached=cached)

    def scan(self, *, check: bool = False) -> ScanReport:
        report = scan(self.catalog, self.tiers, check=check)
        if not check:
            self.last_scan = report
        return report

    # -- content -----------------------------------------------------------------------------
    @property
    def _file_ops(self) -> FileOps:
        if self._files is None:
            raise Unavailable("the engine is not open")
        return self._files

    def open_content(self, file_id: int, *, trust_catalog: bool = False) -> Content:
        """Open a file's bytes for reading and count one access.

        The fd keeps reading the bytes it opened whatever a migration does meanwhile (see
        :meth:`tiering.moves.FileOps.open_content`, and its ``trust_catalog``).
        """
        self.mover.gate.touch()  # moves yield to serving (see tiering.moves.ServingGate)
        hc = self.host_copies  # a current copy of a fleet's origin file on this host's tier
        content = (hc.content(file_id) if hc else None) or self._file_ops.open_content(
            file_id, trust_catalog=trust_catalog
        )
        assert self.access is not None
        self.access.record(content.record.id)
        return content

    def begin_upload(
        self,
        relpath: str,
        *,
        tier: str | None = None,
        overwrite: bool = False,
        expected_size: int | None = None,
    ) -> Upload:
        """Start a crash-safe upload; write to it, then ``commit()`` (or leave it to abort).

        Raises
        ------
        InvalidPath, TierNotFound
            Bad input; nothing is created.
        AlreadyExists
            The relpath exists (in any tier) and ``overwrite`` is false.
        FileBusy
            The file is being migrated.
        TooLarge, InsufficientSpace
            ``expected_size`` is over ``max_upload_bytes``, or over the tier's free space or quota.
        """
        return self._file_ops.begin_upload(
            relpath, tier=tier, overwrite=overwrite, expected_size=expected_size
        )

    def _room(self, tier: Tier, replacing: FileRecord | None) -> int:
        """Bytes that may still be written to ``tier``: free space, capped by its quota."""
        return room(tier, self.catalog, self._policy.quota(tier), replacing)

    def quota(self, tier: str) -> int | None:
        """A tier's quota: the policy's, else the configured one (None: no quota)."""
        return self._policy.quota(self.tiers.get(tier))

    def delete(self, file_id: int) -> FileRecord:
        """Remove a file's bytes and its record; a crash midway leaves a ``missing`` record for
        scan to report, never a resurrected file (see :meth:`tiering.moves.FileOps.delete`)."""
        rec = self._file_ops.delete(file_id)
        if self.memory is not None:
            self.memory.drop(file_id, "deleted")
        return rec

    # -- policy and migrations ---------------------------------------------------------------
    @property
    def journal(self) -> Journal:
        if self._journal is None:
            raise Unavailable("the engine is not open")
        return self._journal

    @property
    def mover(self) -> Mover:
        if self._mover is None:
            raise Unavailable("the engine is not open")
        return self._mover

    @property
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            raise Unavailable("the engine is not open")
        return self._scheduler

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
        now = time.time() if now is None else now
        if scheduler is None:
            scheduler = self._scheduler is not None and self._scheduler.running
        flight = {m.file_id: m.id for m in self.journal.open_intents() if m.file_id is not None}
        for d in decide(
            self.catalog.actionable(),
            self.policy().without(self.tiers.caches),
            self.tier_states(),
            now,
            in_flight=flight,
            scheduler_on=scheduler and self.policy().enabled,
            origins=self.host_copies.origins if self.host_copies else (),
        ):
            if d.file_id == file_id:
                return d
        raise FileNotFound(f"file {file_id} is on no tier the policy knows", file_id=file_id)

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
