"""SQLite connections with the settings RELIABILITY.md asks for, and the Alembic upgrade.

One writer: every write goes through :meth:`Database.write`, which holds a process-wide lock
around a single dedicated connection and opens it with ``BEGIN IMMEDIATE``. SQLite 3.40 (the
version bundled here) has the WAL-reset bug that needs two connections writing or checkpointing
at once, so a single writer connection is a correctness measure, not only a convenience.
Readers use their own small pool with deferred transactions.
"""

from __future__ import annotations

import math
import sqlite3
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from tiering.errors import CatalogBusy, InvalidInput

__all__ = ["BUSY_TIMEOUT_MS", "Database", "make_engine", "migrations_dir", "upgrade"]

BUSY_TIMEOUT_MS = 5000


def decay(heat: float | None, heat_at: float | None, now: float, half_life: float) -> float:
    """Heat halves every ``half_life`` seconds; registered in SQLite as ``tierd_decay``."""
    if not heat:
        return 0.0
    dt = max(0.0, now - (heat_at or now))
    return float(heat) * math.exp2(-dt / half_life) if half_life > 0 else float(heat)


def make_engine(
    url: str, *, writer: bool = False, busy_timeout_ms: int = BUSY_TIMEOUT_MS
) -> Engine:
    """An engine whose connections carry tierd's SQLite settings.

    ``writer`` engines hold exactly one connection and begin every transaction with
    ``BEGIN IMMEDIATE``, so a write never upgrades a read lock half-way (which SQLite answers
    with SQLITE_BUSY and no wait).
    """
    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        raise InvalidInput(f"unsupported catalog URL {url!r}: only sqlite is supported for now")
    if u.database in (None, "", ":memory:"):
        raise InvalidInput("the catalog needs a file: use sqlite:///path/to/catalog.db")
    Path(u.database).parent.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {
        "connect_args": {"check_same_thread": False, "timeout": busy_timeout_ms / 1000}
    }
    if writer:
        kwargs.update(pool_size=1, max_overflow=0, pool_timeout=60)
    engine = create_engine(url, **kwargs)
    begin = "BEGIN IMMEDIATE" if writer else "BEGIN"

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record: object) -> None:
        # Let SQLAlchemy's "begin" event below decide how transactions start.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cur.execute("PRAGMA foreign_keys=ON")
        # FULL: the migration journal lives in this database and must survive power loss.
        cur.execute("PRAGMA synchronous=FULL")
        cur.close()
        dbapi_conn.create_function("tierd_decay", 4, decay, deterministic=True)

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql(begin)

    return engine


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


class Database:
    """The writer connection and the readers of one catalog."""

    def __init__(self, url: str, *, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> None:
        self.url = url
        self._writer = make_engine(url, writer=True, busy_timeout_ms=busy_timeout_ms)
        self._reader = make_engine(url, busy_timeout_ms=busy_timeout_ms)
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

    #: Most files with their own write counter; past it the counters restart (see stamp).
    FILE_GENERATIONS_MAX = 65_536

    @contextmanager
    def write(
        self, *, changes_files: bool = True, files: Collection[int] | None = None
    ) -> Iterator[Session]:
        """A write transaction: committed on exit, rolled back on error.

        ``changes_files=False`` is for writes that change no file's place, state or content (the
        access counters), so cached records stay valid across them. ``files`` narrows a write
        that changes files to the records with these ids: it must change no other record and
        no relpath (a move's claim, switch or release), so cached records of other files, and
        which record a relpath names, stay valid across it.

        Raises
        ------
        CatalogBusy
            When another process held the database past ``busy_timeout``.
        """
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
    def read(self) -> Iterator[Session]:
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
