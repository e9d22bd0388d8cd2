"""The engine: owns the tiers, the catalog and the background threads, and offers the file
operations the service and the CLI are built on."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from sqlalchemy.engine import make_url

from tiering.catalog import (
    Catalog,
    Database,
    FileRecord,
    FileState,
    Migration,
    MigrationPhase,
    NewFile,
    decay,
    upgrade,
)
from tiering.catalog.journal import Journal
from tiering.catalog.policies import PolicyStore, StoredPolicy
from tiering.config import EngineConfig
from tiering.errors import (
    AlreadyExists,
    Conflict,
    FileBusy,
    FileNotFound,
    InsufficientSpace,
    InvalidInput,
    NotFound,
    TooLarge,
    Unavailable,
)
from tiering.moves import (
    AtomicWriter,
    Claim,
    FileGuards,
    Mover,
    Progress,
    RateLimiter,
    RecoveryReport,
)
from tiering.placement import (
    AccessTracker,
    PassReport,
    PlannedMove,
    Policy,
    Scheduler,
    TierState,
    default_policy,
    plan,
)
from tiering.sync import ScanReport, TierWatcher, scan
from tiering.tiers import Space, Tier, Tiers
from tiering.tiers.paths import is_temp_name, validate_relpath

__all__ = ["Content", "Engine", "MigrationInfo", "PolicyInfo", "TierInfo", "Upload"]

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class TierInfo:
    name: str
    rank: int
    path: str
    quota_bytes: int | None
    space: Space
    files: int
    used_bytes: int


@dataclass(frozen=True)
class PolicyInfo:
    """The policy in force; version 0 is the built-in default, never set by anyone."""

    version: int
    policy: Policy
    created_at: float | None
    author: str | None


@dataclass(frozen=True)
class MigrationInfo:
    """One migration, from the journal, with live progress while it is in flight."""

    record: Migration
    bytes_copied: int

    @property
    def in_flight(self) -> bool:
        return self.record.phase in MigrationPhase.OPEN

    @property
    def duration_s(self) -> float | None:
        end = self.record.finished_at
        if end is None:
            return time.time() - self.record.started_at if self.in_flight else None
        return max(0.0, end - self.record.started_at)


class Content:
    """An open file being served: bytes come from this fd, whatever happens to the path."""

    def __init__(self, record: FileRecord, fd: int, size: int) -> None:
        self.record = record
        self.fd = fd
        self.size = size

    def iter_range(self, start: int, end: int, chunk: int = READ_CHUNK) -> Iterator[bytes]:
        """Bytes ``[start, end)`` in chunks; closes the fd when exhausted or closed."""
        try:
            pos = start
            while pos < end:
                data = os.pread(self.fd, min(chunk, end - pos), pos)
                if not data:
                    break
                yield data
                pos += len(data)
        finally:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Upload:
    """One streamed upload; see :meth:`Engine.begin_upload`."""

    def __init__(
        self,
        engine: Engine,
        writer: AtomicWriter,
        previous: FileRecord | None,
        max_bytes: int,
    ) -> None:
        self._engine = engine
        self._writer = writer
        self._previous = previous
        self._max_bytes = max_bytes

    @property
    def size(self) -> int:
        return self._writer.size

    @property
    def replaces(self) -> FileRecord | None:
        """The record this upload overwrites, if any."""
        return self._previous

    def write(self, data: bytes | memoryview) -> None:
        if self._writer.size + len(data) > self._max_bytes:
            raise TooLarge(
                f"upload is larger than max_upload_bytes ({self._max_bytes})",
                limit=self._max_bytes,
            )
        self._writer.write(data)

    def commit(self) -> FileRecord:
        """Publish the bytes, then record them: the catalog commit comes last.

        Replacing a file holds its guard, so the publish cannot land while a migration of the
        same file is between its switch and its source unlink.
        """
        if self._previous is None:
            return self._commit()
        with self._engine.guards.hold(self._previous.id):
            current = self._engine.catalog.find(self._previous.relpath)
            if current is not None and (
                current.state == FileState.MIGRATING or current.tier != self._previous.tier
            ):
                raise FileBusy(
                    f"{self._previous.relpath!r} was migrated during the upload; try again",
                    file_id=self._previous.id,
                )
            return self._commit()

    def _commit(self) -> FileRecord:
        published = self._writer.publish()
        tier = self._writer.tier
        new = NewFile(
            published.relpath, tier.name, published.size, published.mtime_ns, published.checksum
        )
        try:
            rec = self._engine.catalog.upsert(new)
        except BaseException:
            if self._previous is None:
                # Nobody knows these bytes yet: take them back so the failed upload leaves
                # nothing. (An overwrite's bytes stay; scan sees the change and rehashes.)
                tier.unlink(published.relpath)
            raise
        if rec is None:
            raise FileBusy(f"{published.relpath!r} is being migrated; try again")
        prev = self._previous
        if prev is not None and prev.tier != tier.name:
            # The record now names the new tier; the old copy is stale. A crash before this
            # unlink leaves a conflict for scan to report, never a lost file.
            self._engine.tiers.get(prev.tier).unlink(prev.relpath)
        return rec

    def abort(self) -> None:
        self._writer.abort()

    def __enter__(self) -> Upload:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()


class Engine:
    """tierd's engine over one set of tiers and one catalog.

    ``start()`` brings the schema up to date, recovers, scans and starts the background
    threads; ``stop()`` stops them and flushes. Use it as a context manager.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tiers = Tiers(config.tiers)
        if config.default_tier is not None:
            self.tiers.get(config.default_tier)
        self.db: Database | None = None
        self._catalog: Catalog | None = None
        self.access: AccessTracker | None = None
        self._lock_fd = -1
        self.started_at: float | None = None
        self.last_scan: ScanReport | None = None
        self.last_recovery: RecoveryReport | None = None
        # Shared by the mover, uploads and deletes (see FileGuards), and by every migration.
        self.guards = FileGuards()
        self.limiter = RateLimiter()
        self._journal: Journal | None = None
        self._policies: PolicyStore | None = None
        self._mover: Mover | None = None
        self._scheduler: Scheduler | None = None
        self.watcher: TierWatcher | None = None
        self._policy = PolicyInfo(
            0, default_policy(self.config.tier_names(), half_life_s=config.half_life_s), None, None
        )

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            raise Unavailable("the engine is not open")
        return self._catalog

    def open(self, *, upgrade_schema: bool = True) -> Engine:
        """Create tier roots, upgrade the schema and connect; no threads, no scan."""
        for tier in self.tiers:
            tier.ensure_root()
        if upgrade_schema:
            upgrade(self.config.catalog_url)
        self.db = Database(self.config.catalog_url, busy_timeout_ms=self.config.busy_timeout_ms)
        self._catalog = Catalog(self.db)
        self.access = AccessTracker(
            self._catalog,
            half_life_s=self.config.half_life_s,
            interval_s=self.config.access_flush_interval_s,
        )
        self._journal = Journal(self.db)
        self._policies = PolicyStore(self.db)
        self._mover = Mover(
            self._catalog,
            self._journal,
            self.tiers,
            guards=self.guards,
            limiter=self.limiter,
            room=lambda tier: self._room(tier, replacing=None),
        )
        self._scheduler = Scheduler(self._mover, self.policy, self._plan_moves)
        self.reload_policy()
        return self

    def start(self, *, scheduler: bool = True) -> Engine:
        """Open exclusively (one serving process per catalog), then, before serving: recover
        interrupted migrations, remove orphan temp files, scan; then start the threads.

        Recovery comes first: it decides what each open intent's files are, so the temp cleanup
        and the scan that follow see settled state. ``scheduler=False`` leaves policy moves to
        the caller (the CLI runs them in the foreground).
        """
        self._take_lock()
        try:
            self.open()
            self.last_recovery = self.mover.recover()
            self._remove_orphan_temps()
            if self.config.watch:
                # Watch before scanning, so nothing changed during the scan goes unseen.
                self.watcher = TierWatcher(
                    self.catalog,
                    self.tiers,
                    settle_s=self.config.watch_settle_s,
                    backend=self.config.watch_backend,
                    poll_interval_s=self.config.watch_poll_interval_s,
                    reconcile_files_per_s=self.config.reconcile_files_per_s,
                )
                self.watcher.start()
            if self.config.scan_on_start:
                self.last_scan = scan(self.catalog, self.tiers)
            assert self.access is not None
            self.access.start()
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
            ("access", "the final flush of access counts"),
        ):
            part = getattr(self, attr)
            if part is None:
                continue
            try:
                part.stop()
            except Exception:
                log.exception("%s failed", what)
            setattr(self, attr, None)
        if self.db is not None:
            self.db.dispose()
            self.db = None
            self._catalog = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _take_lock(self) -> None:
        db_path = Path(make_url(self.config.catalog_url).database or "catalog.db")
        db_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{db_path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Unavailable(f"another tierd is already serving the catalog {db_path}") from None
        self._lock_fd = fd

    def _remove_orphan_temps(self) -> None:
        """Before serving, nothing is writing: every temp file in tierd's own naming pattern is
        an orphan of a crash, except those of failed migrations (kept as evidence)."""
        keep = self.journal.failed_temp_names()
        for tier in self.tiers:
            for rel in list(tier.temp_files()):
                if not is_temp_name(os.path.basename(rel)) or os.path.basename(rel) in keep:
                    continue
                try:
                    os.unlink(tier.root / rel)
                    log.info("removed orphan temp file %s in tier %s", rel, tier.name)
                except FileNotFoundError:
                    pass

    # -- queries -----------------------------------------------------------------------------
    def heat(self, record: FileRecord, now: float | None = None) -> float:
        """The record's heat decayed to ``now`` with the policy's half-life."""
        now = time.time() if now is None else now
        return decay(record.heat, record.heat_at, now, self._policy.policy.half_life_s)

    def tier_infos(self) -> list[TierInfo]:
        usage = self.catalog.usage()
        out = []
        for t in self.tiers:
            u = usage.get(t.name)
            out.append(
                TierInfo(
                    t.name,
                    t.rank,
                    str(t.root),
                    t.quota_bytes,
                    t.space(),
                    u.files if u else 0,
                    u.bytes if u else 0,
                )
            )
        return out

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
    def open_content(self, file_id: int) -> Content:
        """Open a file's bytes for reading and count one access.

        The fd is opened beneath the tier root; if a migration switches the file meanwhile, the
        fd keeps reading the bytes it opened. If the catalog moved the file between our read of
        the record and the open (the source is unlinked only after the switch commits), the
        record is read again; only a record that did not change is reported missing.
        """
        rec = self.catalog.get(file_id, cached=True)
        for _ in range(8):
            if rec.state == FileState.MISSING:
                raise FileNotFound(f"file {file_id} ({rec.relpath}) is missing on disk")
            try:
                fd, st = self.tiers.get(rec.tier).open_read(rec.relpath)
            except FileNotFound:
                again = self.catalog.get(file_id)
                if (again.tier, again.generation) == (rec.tier, rec.generation):
                    break
                rec = again  # switched to another tier between get and open: look again
                continue
            assert self.access is not None
            self.access.record(rec.id)
            return Content(rec, fd, st.st_size)
        raise FileNotFound(f"file {file_id} is not on disk where the catalog says")

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
        relpath = validate_relpath(relpath)
        previous = self.catalog.find(relpath)
        if tier is None:
            tier = previous.tier if previous else self.config.default_tier
        target: Tier = self.tiers.get(tier) if tier else self.tiers.fastest
        if expected_size is not None and expected_size < 0:
            raise InvalidInput("size must not be negative")
        if previous is not None:
            if not overwrite:
                raise AlreadyExists(
                    f"{relpath!r} already exists (id {previous.id}, tier {previous.tier}); "
                    "pass overwrite=true to replace it",
                    path=relpath,
                    file_id=previous.id,
                )
            if previous.state == FileState.MIGRATING:
                raise FileBusy(f"{relpath!r} is being migrated; try again", file_id=previous.id)
        max_bytes = self.config.max_upload_bytes
        if expected_size is not None and expected_size > max_bytes:
            raise TooLarge(
                f"upload of {expected_size} bytes is over max_upload_bytes ({max_bytes})",
                limit=max_bytes,
            )
        limit = self._room(target, replacing=previous)
        if expected_size is not None and expected_size > limit:
            raise InsufficientSpace(
                f"tier {target.name} has room for {limit} bytes, upload needs {expected_size}",
                tier=target.name,
                free=limit,
            )
        writer = AtomicWriter(target, relpath, overwrite=overwrite, limit=limit)
        return Upload(self, writer, previous, max_bytes)

    def _room(self, tier: Tier, replacing: FileRecord | None) -> int:
        """Bytes that may still be written to ``tier``: free space, capped by its quota."""
        room = tier.space().free
        quota = self.quota(tier.name)
        if quota is not None:
            used = self.catalog.usage().get(tier.name)
            used_bytes = used.bytes if used else 0
            if replacing is not None and replacing.tier == tier.name:
                used_bytes -= replacing.size
            room = min(room, max(0, quota - used_bytes))
        return room

    def quota(self, tier: str) -> int | None:
        """A tier's quota: the policy's, else the configured one (None: no quota)."""
        tp = self._policy.policy.tiers.get(tier)
        if tp is not None and tp.quota_bytes is not None:
            return tp.quota_bytes
        return self.tiers.get(tier).quota_bytes

    def delete(self, file_id: int) -> FileRecord:
        """Remove a file's bytes and its record.

        The bytes are unlinked while the catalog's write lock is held, then the deletion
        commits: a busy catalog changes nothing, and a crash in between leaves a ``missing``
        record for scan to report, never a resurrected file.
        """
        with self.guards.hold(file_id):
            rec = self.catalog.get(file_id)
            if rec.state == FileState.MIGRATING:
                raise FileBusy(f"file {file_id} is being migrated; try again", file_id=file_id)
            tier = self.tiers.get(rec.tier)
            unlink = lambda r: tier.unlink(r.relpath)  # noqa: E731
            if not self.catalog.delete(file_id, generation=rec.generation, before_commit=unlink):
                raise FileBusy(
                    f"file {file_id} changed while it was being deleted", file_id=file_id
                )
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
        return self._policy

    def reload_policy(self) -> PolicyInfo:
        """Pick up the newest stored policy (cheap when it did not change)."""
        assert self._policies is not None
        if self._policies.latest_version() != self._policy.version:
            stored = self._policies.latest()
            if stored is not None:
                self._apply_policy(stored)
        self.limiter.set_rate(self._policy.policy.bandwidth_bytes_per_s)
        if self.access is not None:
            self.access.half_life_s = self._policy.policy.half_life_s
        return self._policy

    def _apply_policy(self, stored: StoredPolicy) -> None:
        try:
            policy = Policy.parse(stored.document, self.config.tier_names())
        except InvalidInput as exc:
            # Stored under another tier list: keep serving with the current one, loudly.
            log.error("stored policy version %d does not fit these tiers: %s", stored.version, exc)
            return
        self._policy = PolicyInfo(stored.version, policy, stored.created_at, stored.author)

    def set_policy(self, document: object, *, author: str | None = None) -> PolicyInfo:
        """Validate and store a policy document as the next version, and apply it now.

        Raises
        ------
        InvalidPolicy
            The document does not validate (nothing is stored).
        """
        policy = Policy.parse(document, self.config.tier_names())
        assert self._policies is not None
        stored = self._policies.save(policy.document(), author=author)
        self._policy = PolicyInfo(stored.version, policy, stored.created_at, stored.author)
        self.reload_policy()
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.wake()
        return self._policy

    def tier_states(self) -> dict[str, TierState]:
        usage = self.catalog.usage()
        out = {}
        for t in self.tiers:
            u = usage.get(t.name)
            out[t.name] = TierState(t.name, u.bytes if u else 0, t.space().free, t.quota_bytes)
        return out

    def plan(self, policy: Policy | None = None, now: float | None = None) -> list[PlannedMove]:
        """The moves ``policy`` (default: the one in force) would make now: a dry run."""
        policy = policy or self.policy()
        now = time.time() if now is None else now
        return plan(self.catalog.all(), policy, self.tier_states(), now)

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
        self.tiers.get(to_tier)
        rec = self.mover.migrate(file_id, to_tier, reason=reason, progress=progress)
        return MigrationInfo(rec, rec.bytes_copied)

    def submit_move(self, file_id: int, to_tier: str, *, reason: str = "manual") -> Claim:
        """Claim a move now (so conflicts are reported at once) and queue it on the scheduler.

        Without a running scheduler the move runs in this thread before returning.
        """
        self.tiers.get(to_tier)
        claim = self.mover.claim(file_id, to_tier, reason=reason)
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.submit(claim)
        else:
            # A failure is recorded on the claim and in the journal.
            with contextlib.suppress(Exception):
                self.mover.run(claim)
        return claim

    def run_plan(self) -> PassReport:
        """Plan now and claim every planned move; they run on the scheduler's workers (or in
        this thread, one after another, without a running scheduler)."""
        self.reload_policy()
        sched = self.scheduler
        if sched.running:
            return sched.run_pass(self.policy())
        report = PassReport(started_at=time.time())
        moves = self.plan()
        report.planned = len(moves)
        for move in moves:
            try:
                claim = self.mover.claim(move.file_id, move.dst, reason=move.reason)
            except (FileBusy, FileNotFound, Conflict) as exc:
                report.skipped.append((move, exc.message))
                continue
            report.claimed.append(claim)
            # A failure is recorded on the claim and in the journal.
            with contextlib.suppress(Exception):
                self.mover.run(claim)
        return report

    def migration(self, intent_id: int) -> MigrationInfo:
        row = self.journal.get(intent_id)
        if row is None:
            raise NotFound(f"no migration with id {intent_id}", migration_id=intent_id)
        return self._info(row)

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
        return [self._info(r) for r in rows]

    def _info(self, row: Migration) -> MigrationInfo:
        live = self.mover.progress().get(row.id) if row.phase in MigrationPhase.OPEN else None
        return MigrationInfo(row, live if live is not None else row.bytes_copied)

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
