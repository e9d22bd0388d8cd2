"""The catalog's database: its transactions, its backends' errors, and the Alembic upgrade.

SQLite has one writer: every write goes through :meth:`Database.write`, which holds a
process-wide lock around a single dedicated connection opened with ``BEGIN IMMEDIATE`` (see
:mod:`tiering.catalog.backends` for why). PostgreSQL has many: each write is its own READ
COMMITTED transaction that locks the rows it decides on, and :meth:`Database.transact` retries
one that lost a deadlock. Readers use their own pool on both.

PostgreSQL may also be down or cut off: every call then raises
:class:`~tiering.errors.CatalogUnreachable`, and :attr:`Database.outage` says why and since when
until a statement succeeds again (logged once each way, not once per failed call), so the parts
that pause meanwhile (moves, the memory tier's passes) and ``/readyz`` can ask without a query.
:attr:`Database.outages` counts them, for the parts that settle what an outage interrupted once
it is over (the scheduler's :func:`~tiering.moves.recovery.settle`).

A restart of PostgreSQL also drops this host's advisory lock (:mod:`tiering.catalog.lock`). So
after an outage the first write takes it again before it runs; if another tierd with the same
host id took it meanwhile, every write of this process fails from then on with
:class:`~tiering.errors.HostLockLost` (:attr:`Database.fenced` says why), rather than two
processes acting as one host.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from tiering.catalog.backends import (
    DEADLOCK,
    LOCK_TIMEOUT,
    QUERY_CANCELED,
    SERIALIZATION_FAILURE,
    SQLITE,
    UNIQUE_VIOLATION,
    backend_of,
    decay,
    make_engine,
    normalize_url,
    redact,
    sqlstate,
)
from tiering.catalog.lock import CatalogLock
from tiering.errors import CatalogBusy, CatalogUnreachable, HostLockLost, Unavailable

__all__ = [
    "BUSY_TIMEOUT_MS",
    "Database",
    "Outage",
    "decay",
    "make_engine",
    "migrations_dir",
    "upgrade",
]

log = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 5000

T = TypeVar("T")


def migrations_dir() -> Path:
    """Where the Alembic scripts live: packaged inside the wheel, or beside the source tree."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "_migrations", here.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError("tierd's Alembic migrations are missing from this installation")


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the catalog at ``url`` to ``revision`` with Alembic (the only schema creator)."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["url"] = url
    command.upgrade(cfg, revision)


def _is_busy(exc: OperationalError) -> bool:
    text = str(exc.orig).lower()
    return "locked" in text or "busy" in text


def _unreachable(exc: DBAPIError) -> bool:
    """A lost or refused connection (libpq reports no SQLSTATE then), or a server going down."""
    state = sqlstate(exc)
    return bool(exc.connection_invalidated) or (
        isinstance(exc, OperationalError)
        and (state is None or state.startswith("08") or state in ("57P01", "57P02", "57P03"))
    )


@dataclass(frozen=True)
class Outage:
    """The catalog's database has not answered since ``since`` (epoch seconds), for ``reason``
    (the last failure's, without credentials)."""

    since: float
    reason: str


class Database:
    """The writers and the readers of one catalog (SQLite or PostgreSQL)."""

    #: How many times :meth:`transact` runs a write again after a deadlock or serialization
    #: failure (PostgreSQL), with a short random backoff.
    RETRIES = 8

    def __init__(
        self,
        url: str,
        *,
        busy_timeout_ms: int = BUSY_TIMEOUT_MS,
        name: str = "tierd",
        host: str | None = None,
        shared_tiers: Collection[str] = (),
        readers: int | None = None,
    ) -> None:
        self.url = normalize_url(url)
        #: This host's id, written on the records of files it places on its own tiers, and the
        #: tiers every host shares (object stores), whose records name no host.
        self.host = host
        self.shared_tiers = frozenset(shared_tiers)
        self.backend = backend_of(self.url)
        #: SQLite: one writer connection, and this process the only writer (its CatalogLock);
        #: PostgreSQL: many writers, here and on other hosts.
        self.single_writer = self.backend == SQLITE
        self._writer = make_engine(
            self.url, writer=True, busy_timeout_ms=busy_timeout_ms, name=name
        )
        # ``readers``: the read connections kept open (PostgreSQL; see make_engine's ``keep``).
        self._reader = make_engine(
            self.url, busy_timeout_ms=busy_timeout_ms, name=name, keep=readers
        )
        self._write_lock = threading.Lock()
        # Bumped by every committed write that may change where or what a file is; caches of
        # records are valid while it stands still (see Catalog's cached reads).
        self.generation = 0
        # The same, per file, for writes that name the files they change (``write(files=)``):
        # a move changes one record, and must not send every read of every other file back to
        # SQLite. Kept to a bounded number of files (see _bump_files).
        self._file_generations: dict[int, int] = {}
        self._write_sessions = sessionmaker(self._writer, expire_on_commit=False)
        self._read_sessions = sessionmaker(self._reader, expire_on_commit=False)
        self._outage: Outage | None = None
        self._outage_lock = threading.Lock()
        #: Outages so far (PostgreSQL): a part that settles after one compares it with its own.
        self.outages = 0
        self._back: list[Callable[[], None]] = []
        self._host_lock: CatalogLock | None = None
        self._lock_stale = False  # an outage may have dropped the host lock: verify first
        self._relock = threading.Lock()
        self._fenced: str | None = None

    @property
    def outage(self) -> Outage | None:
        """Why the database cannot be reached, since the first failure of this outage; None
        while it answers (or before anything noticed otherwise). Only PostgreSQL has one."""
        return self._outage

    @property
    def fenced(self) -> str | None:
        """Why this process writes nothing any more (another took its host's lock), or None."""
        return self._fenced

    def on_back(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` when the database answers again after an outage; it runs in the thread
        whose statement succeeded, so it must only wake a thread of its own."""
        self._back.append(wake)

    def serve_under(self, lock: CatalogLock) -> None:
        """Make ``lock`` (held: this host's serving lock) the condition of every write: after
        an outage it is verified, and taken again, before the next write runs."""
        self._host_lock = lock

    def check_host_lock(self) -> bool:
        """Verify the host lock now (taking it again where PostgreSQL dropped it); False, and
        :attr:`fenced` set, when another process took it. Call it now and then: a restart of
        PostgreSQL between two statements drops the lock without an outage being seen.

        Raises
        ------
        CatalogUnreachable
            PostgreSQL cannot be reached (the check runs again before the next write).
        """
        lock = self._host_lock
        if lock is None or self.single_writer or self._fenced is not None:
            return self._fenced is None
        with self._relock:
            try:
                held = lock.verify()
            except Unavailable as exc:
                self._went_down(exc.message)
                raise CatalogUnreachable(exc.message) from exc
            if held:
                self._lock_stale = False
                return True
            self._fenced = (
                f"another tierd with host id {lock.host_id!r} took this host's lock on the "
                f"catalog {redact(self.url)} while PostgreSQL was restarting ({lock.holder}); "
                "this process no longer writes the catalog: stop one of the two and restart "
                "the other"
            )
        log.error("%s", self._fenced)
        return False

    def _before_write(self) -> None:
        if self._lock_stale:
            self.check_host_lock()
        if self._fenced is not None:
            raise HostLockLost(self._fenced)

    def owner_of(self, tier: str) -> str | None:
        """The host to record on a file placed on ``tier`` (None: a shared tier)."""
        return None if tier in self.shared_tiers else self.host

    #: Most files with their own write counter; past it the counters restart (see stamp).
    FILE_GENERATIONS_MAX = 65_536

    @property
    def caches_records(self) -> bool:
        """Whether records may be kept in memory across requests (see Catalog's cached reads).

        Only where this process is the catalog's only writer: on PostgreSQL another host may
        move or rewrite a file at any moment, and nothing here would hear of it.
        """
        return self.single_writer

    @contextmanager
    def write(
        self, *, changes_files: bool = True, files: Collection[int] | None = None
    ) -> Iterator[Session]:
        """A write transaction: committed on exit, rolled back on error.

        ``changes_files=False`` is for writes that change no file's place, state or content (the
        access counters), so cached records stay valid across them. ``files`` narrows a write
        that changes files to the records with these ids: it must change no other record and
        no relpath (a move's claim, switch or release), so cached records of other files, and
        which record a relpath names, stay valid across it. Both only matter where records are
        cached (:attr:`caches_records`).

        On PostgreSQL the body must lock the rows it decides on (see
        :mod:`tiering.catalog.backends`); use :meth:`transact` to have lost deadlocks retried.

        Raises
        ------
        CatalogBusy
            When another writer held the database (SQLite) or a row (PostgreSQL) past
            ``busy_timeout``.
        CatalogUnreachable
            PostgreSQL cannot be reached.
        """
        if not self.single_writer:
            self._before_write()
            with self._postgresql_errors(), self._write_sessions() as session, session.begin():
                yield session
            return
        ids = tuple(files) if changes_files and files is not None else None
        with self._write_lock:
            try:
                # Odd while writing: a record read now is not cached (see Catalog).
                if ids is not None:
                    self._bump_files(ids, before=True)
                elif changes_files:
                    self.generation += 1
                try:
                    with self._write_sessions() as session, session.begin():
                        yield session
                finally:
                    if ids is not None:
                        self._bump_files(ids, before=False)
                    elif changes_files:
                        self.generation += 1
            except OperationalError as exc:
                if _is_busy(exc):
                    raise CatalogBusy(
                        "the catalog stayed locked by another process; try again"
                    ) from exc
                raise

    def transact(
        self,
        body: Callable[[Session], T],
        *,
        changes_files: bool = True,
        files: Collection[int] | None = None,
        retry_unique: bool = False,
        may_retry: Callable[[], bool] | None = None,
    ) -> T:
        """Run ``body`` in a :meth:`write` transaction and return what it returns.

        On PostgreSQL a transaction that lost a deadlock or a serialization failure rolled back
        whole, and runs again (up to :attr:`RETRIES` times). ``retry_unique`` also retries a
        unique violation: two hosts inserting the same row at once (the body must find the
        other's row the second time). ``may_retry`` is asked before each retry, for a body
        with effects outside the database (it says False once they happened). SQLite never
        needs a retry: its one writer waits for the database up front.
        """
        attempt = 0
        while True:
            try:
                with self.write(changes_files=changes_files, files=files) as session:
                    return body(session)
            except DBAPIError as exc:
                state = sqlstate(exc)
                retryable = state in (DEADLOCK, SERIALIZATION_FAILURE) or (
                    retry_unique and state == UNIQUE_VIOLATION
                )
                if not retryable or (may_retry is not None and not may_retry()):
                    raise
                if attempt >= self.RETRIES:
                    raise CatalogBusy(
                        f"a catalog write kept conflicting with other writers ({state}); try again"
                    ) from exc
            attempt += 1
            # Random, so two writers that deadlocked do not meet again at once.
            time.sleep(random.uniform(0.0, 0.002 * (2 ** min(attempt, 6))))

    @contextmanager
    def _postgresql_errors(self) -> Iterator[None]:
        try:
            yield
        except DBAPIError as exc:
            state = sqlstate(exc)
            if state in (LOCK_TIMEOUT, QUERY_CANCELED):
                raise CatalogBusy(
                    "a catalog row stayed locked by another writer past busy_timeout; try again"
                ) from exc
            if _unreachable(exc):
                lines = str(exc.orig).strip().splitlines() if exc.orig else []
                reason = lines[0] if lines else type(exc).__name__
                message = f"the catalog database {redact(self.url)} cannot be reached: {reason}"
                self._went_down(message)
                raise CatalogUnreachable(message) from exc
            raise
        if self._outage is not None:  # one attribute read on the hot path
            self._came_back()

    def _went_down(self, reason: str) -> None:
        with self._outage_lock:
            if self._outage is not None:
                return
            self._outage = Outage(time.time(), reason)
            self.outages += 1
            self._lock_stale = self._host_lock is not None
        # Pooled connections died with the server (or will fail once each when it returns):
        # drop the idle ones now, so the first reads after it returns open fresh ones.
        self._reader.dispose()
        self._writer.dispose()
        log.warning(
            "%s; serving loads of local files from last known records, moves and fleet jobs "
            "paused until it answers again",
            reason,
        )

    def _came_back(self) -> None:
        with self._outage_lock:
            outage, self._outage = self._outage, None
        if outage is not None:
            log.warning(
                "the catalog database %s answers again after %.1f s; moves resume",
                redact(self.url),
                time.time() - outage.since,
            )
            for wake in self._back:
                wake()

    def _bump_files(self, files: Collection[int], *, before: bool) -> None:
        """Called holding the write lock, before and after a scoped write."""
        gens = self._file_generations
        if before and len(gens) >= self.FILE_GENERATIONS_MAX:
            # No scoped write is in progress (we hold the lock): restart the counters, and
            # move the global generation past every stamp taken with the old ones.
            gens.clear()
            self.generation += 2
        for f in files:
            gens[f] = gens.get(f, 0) + 1

    def stamp(self, file_id: int) -> tuple[int, int]:
        """What a cached record of ``file_id`` is valid for: take it *before* reading the record;
        the record may be kept while :meth:`stamp` still returns the same pair, and only if
        both numbers are even (no write that may change it was in progress)."""
        return self.generation, self._file_generations.get(file_id, 0)

    @contextmanager
    def publish_lock(self, relpath: str) -> Iterator[None]:
        """Hold the fleet-wide lock on ``relpath``'s publishing: on PostgreSQL a session
        advisory lock (keyed by a hash of the relpath) on a connection of its own, waited for;
        on SQLite nothing, as one host writes the catalog.

        Writers of a shared tier's object (an overwrite, a delete) hold it from the moment the
        bucket changes until the catalog records it, so two hosts' changes of one object take
        turns and the catalog always names the bytes the bucket holds: without it, one host's
        upload could complete between another's and that one's catalog commit, leaving the
        record naming the first bytes over the second. A lost connection ends the session, and
        with it the lock."""
        if self.single_writer:
            yield
            return
        digest = hashlib.blake2b(f"tierd publish {relpath}".encode(), digest_size=8).digest()
        key = int.from_bytes(digest, "big", signed=True)
        with self._postgresql_errors(), self._writer.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
            conn.commit()
            try:
                yield
            finally:
                with contextlib.suppress(DBAPIError):
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                    conn.commit()

    @contextmanager
    def read(self) -> Iterator[Session]:
        if not self.single_writer:
            with self._postgresql_errors(), self._read_sessions() as session, session.begin():
                yield session
            return
        try:
            with self._read_sessions() as session, session.begin():
                yield session
        except OperationalError as exc:
            if _is_busy(exc):
                raise CatalogBusy("the catalog is busy; try again") from exc
            raise

    def dispose(self) -> None:
        self._writer.dispose()
        self._reader.dispose()
