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
from collections.abc import Callable, Collection
from types import TracebackType

from tiering.catalog import (
    Catalog,
    CatalogLock,
    Copies,
    Database,
    FileRecord,
    FileState,
    decay,
    upgrade,
)
from tiering.catalog.backends import sqlite_file
from tiering.catalog.journal import Journal
from tiering.catalog.policies import PolicyStore
from tiering.config import EngineConfig
from tiering.copies import HostCopies, MemoryCache
from tiering.errors import IntegrityError, TierUnavailable
from tiering.fleet import Heartbeat, PeerUploads, adopt_local_records, host_database, peers_off
from tiering.integrity import DamageLog
from tiering.moves import (
    Content,
    FileGuards,
    FileOps,
    MigrationInfo,
    Mover,
    RateLimiter,
    RecoveryReport,
    Upload,
    remove_orphan_temps,
)
from tiering.placement import (
    AccessTracker,
    CurrentPolicy,
    PolicyInfo,
    TierInfo,
    room,
    tier_infos,
)
from tiering.sync import ScanReport, TierWatcher, relocate_containers, scan
from tiering.tiers import Source, Tier, Tiers
from tiering.tiers.paths import validate_relpath

from .scheduler import Scheduler
from .steering import Steering, _opened

# The views and handles the service builds on are re-exported here, so callers import the
# engine's API from one place whichever room defines each piece.
__all__ = ["Content", "Engine", "MigrationInfo", "PolicyInfo", "TierInfo", "Upload"]

log = logging.getLogger(__name__)

#: Reasons of an object store's unavailability that are outages (it does not answer, or keeps
#: failing), not a configuration to fix: start-up goes on without it.
OUTAGES = ("unreachable", "unavailable")


class Engine(Steering):
    """tierd's engine over one set of tiers and one catalog. ``start()`` brings the schema up
    to date, recovers, scans and starts the background threads; ``stop()`` stops them and
    flushes. Use it as a context manager."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        memory = config.memory
        self.tiers = Tiers(
            config.tiers,
            caches=[memory.name] if memory is not None else [],
            catalog=sqlite_file(config.catalog_url),  # never inside a tier root
        )
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
        # What this process found damaged (reads, scans): /readyz, /metrics, and the scans'
        # memory of what not to hash again (tiering.integrity).
        self.damage = DamageLog()
        #: Why this host reads shared files without its peers, or None (tiering.fleet.peers_off).
        self.peers_off: str | None = None
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
        #: What this host serves its fleet's peers, and from which copy (built by open()).
        self.peers: PeerUploads | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def catalog(self) -> Catalog:
        return _opened(self._catalog)

    def open(self, *, upgrade_schema: bool = True) -> Engine:
        """Check the tiers (a directory root is created; a bucket must answer and take a
        write), upgrade the schema and connect; no threads, no scan.

        Raises :class:`~tiering.errors.TierUnavailable` naming the tier and why it is unusable.
        """
        for tier in self.tiers:
            try:
                tier.check()
            except TierUnavailable as exc:
                # A store that is down (not misconfigured) must not keep the local tiers from
                # serving: it is degraded (/readyz), its moves fail and are retried.
                if tier.capabilities.local_files or exc.details.get("reason") not in OUTAGES:
                    raise
                log.warning("%s; serving the other tiers meanwhile", exc.message)
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
            self.db,
            self._catalog,
            self._files,
            self.tiers,
            policy=self.policy,
            quota=self._policy.quota,
            limiter=self.limiter,
            config=self.config,
        )
        if self.memory is not None:  # its fills of shared files go through a copy here
            self.memory.source.host_copies = self.host_copies
        self.peers = PeerUploads(
            memory=self.memory.tier if self.memory is not None else None,
            copies=self.host_copies,
            host_id=self.config.host_id,
            open_own=self.open_content,
        )
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
            self.peers_off = peers_off(self.catalog.db, self.tiers, self.config.fleet_token)
            if self.peers_off is not None:
                log.warning("%s", self.peers_off)
            relocate_containers(self.catalog, self.tiers)  # an earlier tierd's layout, once
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
                    damage=self.damage,
                )
                self.watcher.start()
            if self.config.scan_on_start:
                self.last_scan = scan(self.catalog, self.tiers, damage=self.damage)
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
        if self._mover is not None:  # its copy process, once no move runs (None: never opened)
            self._mover.close()
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
        report = scan(self.catalog, self.tiers, check=check, damage=self.damage)
        if not check:
            self.last_scan = report
        return report

    # -- content -----------------------------------------------------------------------------
    @property
    def _file_ops(self) -> FileOps:
        return _opened(self._files)

    def open_content(
        self,
        file_id: int,
        *,
        trust_catalog: bool = False,
        count: bool = True,
        via: Callable[[FileRecord], Source | None] | None = None,
    ) -> Content:
        """Open a file's bytes for reading and count one access (``count=False``: the caller
        counts it, with :meth:`count_access`, once it knows bytes will be read).

        The fd keeps reading the bytes it opened whatever a migration does meanwhile (see
        :meth:`tiering.moves.FileOps.open_content`, and its ``trust_catalog``).
        """
        self.mover.gate.touch()  # moves yield to serving (see tiering.moves.ServingGate)
        hc = self.host_copies  # a current copy of a fleet's origin file on this host's tier
        content = (hc.content(file_id) if hc else None) or self._via(file_id, via)
        if content is None:
            content = self._file_ops.open_content(file_id, trust_catalog=trust_catalog)
        if count:
            self.count_access(content.record.id)
        content.on_damage = self._damaged
        return content

    def _via(
        self, file_id: int, via: Callable[[FileRecord], Source | None] | None
    ) -> Content | None:
        """The file read through ``via`` (a fleet's peers: the serving layer's), where it
        gives a source; None to read it from its tier."""
        if via is None:
            return None
        rec = self.catalog.get(file_id, cached=True)
        source = via(rec)
        return None if source is None else Content(rec, source)

    def count_access(self, file_id: int) -> None:
        """One access of the file (its heat): a read that serves bytes."""
        assert self.access is not None
        self.access.record(file_id)

    def _damaged(self, content: Content, exc: IntegrityError) -> None:
        """A read found the file's stored bytes damaged: quarantined once, logged once."""
        rec = content.record
        self.damage.note(
            rec.tier,
            rec.relpath,
            content.source.version_on_disk(),
            exc,
            file_id=rec.id,
            quarantine=lambda fid, detail: self.catalog.set_state(
                [fid], FileState.QUARANTINED, detail
            ),
        )

    def begin_upload(
        self,
        relpath: str,
        *,
        tier: str | None = None,
        overwrite: bool = False,
        expected_size: int | None = None,
        checksum: str | None = None,
        if_match: Collection[str] | None = None,
    ) -> Upload:
        """Start a crash-safe upload; write to it, then ``commit()`` (or leave it to abort).
        ``checksum``: what the bytes must hash to; ``if_match``: the checksums one of which the
        file being replaced must have (see :meth:`tiering.moves.FileOps.begin_upload`).

        Raises
        ------
        InvalidPath, TierNotFound
            Bad input; nothing is created.
        AlreadyExists
            The relpath exists (in any tier) and ``overwrite`` is false.
        PreconditionFailed
            ``if_match`` names none of the current file's versions.
        FileBusy
            The file is being migrated.
        TooLarge, InsufficientSpace
            ``expected_size`` is over ``max_upload_bytes``, or over the tier's free space or quota.
        """
        return self._file_ops.begin_upload(
            relpath,
            tier=tier,
            overwrite=overwrite,
            expected_size=expected_size,
            checksum=checksum,
            if_match=if_match,
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
