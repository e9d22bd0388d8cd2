"""The two catalog backends: SQLite for one host, PostgreSQL for hosts that share a catalog.

**SQLite** gets the settings RELIABILITY.md asks for: WAL, ``busy_timeout``, foreign keys,
``synchronous=FULL``, and ``BEGIN IMMEDIATE`` for writes. SQLite 3.40 (the version bundled here)
has the WAL-reset bug that needs two connections writing or checkpointing at once, so the writer
engine holds a single connection, and one process per catalog (:class:`CatalogLock`).

**PostgreSQL** (``postgresql+psycopg://user@host:5432/db``) runs READ COMMITTED transactions, and
every write locks the rows it decides on (``SELECT ... FOR UPDATE``) before reading them, files
first and in id order, then intents, then copies: a compare-and-set sees the last committed
row, and two writers wait for each other instead of both winning. A deadlock or serialization
failure that slips through is retried by :meth:`Database.transact`. ``busy_timeout`` becomes
PostgreSQL's ``lock_timeout``, so a write waits for a row as long as SQLite waits for its lock.
Reads run in autocommit: each statement sees the last commit, as a READ COMMITTED transaction
would, with one round trip instead of three.

LIKE is case-sensitive on both (relpaths are case-sensitive; SQLite's default is not).
"""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Engine,
    Float,
    bindparam,
    case,
    create_engine,
    event,
    func,
    text,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from tiering.errors import InvalidInput

__all__ = [
    "sqlite_file",
    "FOR_DELETE",
    "FOR_KEY_SHARE",
    "FOR_UPDATE_UNQUEUED",
    "FOR_WRITE",
    "POSTGRESQL",
    "SQLITE",
    "backend_of",
    "decay",
    "decayed_heat",
    "make_engine",
    "normalize_url",
    "redact",
    "relax_commit",
    "sqlstate",
]

SQLITE = "sqlite"
POSTGRESQL = "postgresql"
_PG_DRIVER = "postgresql+psycopg"

# Row locks, as ``with_for_update`` arguments (``Session.get(with_for_update=X)``,
# ``select().with_for_update(**X)``); SQLite ignores them, its writer holds the whole database.
# A write that changes a row but not its key takes FOR NO KEY UPDATE, which rows that merely
# reference it (an intent, a copy) do not wait for; a delete, or a change of the relpath (a
# unique key), takes FOR UPDATE; a write that needs the row to stay (a copy of it) takes FOR
# KEY SHARE, which waits only for those. FOR_UPDATE_UNQUEUED waits for no one: no row when
# another transaction holds the lock.
FOR_WRITE: dict[str, Any] = {"key_share": True}
FOR_DELETE: dict[str, Any] = {}
FOR_KEY_SHARE: dict[str, Any] = {"read": True, "key_share": True}
FOR_UPDATE_UNQUEUED: dict[str, Any] = {"skip_locked": True}

# PostgreSQL's SQLSTATEs tierd acts on.
SERIALIZATION_FAILURE = "40001"
DEADLOCK = "40P01"
UNIQUE_VIOLATION = "23505"
LOCK_TIMEOUT = "55P03"
QUERY_CANCELED = "57014"

_EXAMPLES = "sqlite:////path/to/catalog.db or postgresql+psycopg://user@host:5432/tierd"


def decay(heat: float | None, heat_at: float | None, now: float, half_life: float) -> float:
    """Heat halves every ``half_life`` seconds; registered in SQLite as ``tierd_decay``."""
    if not heat:
        return 0.0
    dt = max(0.0, now - (heat_at or now))
    return float(heat) * math.exp2(-dt / half_life) if half_life > 0 else float(heat)


def redact(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparsable URL>"


def normalize_url(url: str) -> str:
    """Check a catalog URL and return the form tierd connects with.

    ``postgresql://`` means psycopg 3 (the driver tierd installs); SQLite needs a file.

    Raises
    ------
    InvalidInput
        Not a URL, another database, another PostgreSQL driver, or no database named.
    """
    try:
        u = make_url(url)
    except ArgumentError:
        raise InvalidInput(
            f"catalog_url {redact(url)!r} is not a database URL; use {_EXAMPLES}"
        ) from None
    backend = u.get_backend_name()
    if backend == SQLITE:
        if u.drivername not in (SQLITE, "sqlite+pysqlite"):
            raise InvalidInput(f"catalog_url {redact(url)!r}: use sqlite:///path/to/catalog.db")
        if u.database in (None, "", ":memory:"):
            raise InvalidInput("the catalog needs a file: use sqlite:///path/to/catalog.db")
        return url
    if backend == POSTGRESQL:
        if u.drivername == POSTGRESQL:
            u = u.set(drivername=_PG_DRIVER)
        if u.drivername != _PG_DRIVER:
            raise InvalidInput(
                f"catalog_url {redact(url)!r}: tierd talks to PostgreSQL through psycopg 3; "
                "use postgresql+psycopg://"
            )
        if not u.database:
            raise InvalidInput(
                f"catalog_url {redact(url)!r} names no database: use "
                "postgresql+psycopg://user@host:5432/tierd"
            )
        return u.render_as_string(hide_password=False)
    raise InvalidInput(f"unsupported catalog URL {redact(url)!r}: use {_EXAMPLES}")


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite catalog URL; None for another database."""
    try:
        u = make_url(url)
    except ArgumentError:
        return None
    if u.get_backend_name() != SQLITE or not u.database or u.database == ":memory:":
        return None
    return Path(u.database)


def backend_of(url: str) -> str:
    """``sqlite`` or ``postgresql``, for a URL :func:`normalize_url` accepts."""
    return make_url(normalize_url(url)).get_backend_name()


def sqlstate(exc: DBAPIError) -> str | None:
    """PostgreSQL's SQLSTATE of a driver error (None for SQLite and for lost connections)."""
    state = getattr(exc.orig, "sqlstate", None)
    return state if isinstance(state, str) else None


def make_engine(
    url: str,
    *,
    writer: bool = False,
    busy_timeout_ms: int = 5000,
    name: str = "tierd",
    dedicated: bool = False,
    keep: int | None = None,
) -> Engine:
    """An engine with tierd's settings for ``url``'s backend (see the module docstring).

    ``writer`` engines are for write transactions; ``name`` is the PostgreSQL
    ``application_name`` (what ``pg_stat_activity`` shows); a ``dedicated`` PostgreSQL engine
    pools nothing, so that closing a connection ends its session (an advisory lock's holder);
    ``keep``: the PostgreSQL connections the pool keeps open (default 2 writers, 4 readers;
    more are opened for a burst and closed after it).
    """
    url = normalize_url(url)
    if backend_of(url) == SQLITE:
        return _sqlite_engine(url, writer=writer, busy_timeout_ms=busy_timeout_ms)
    return _postgresql_engine(
        url,
        writer=writer,
        busy_timeout_ms=busy_timeout_ms,
        name=name,
        dedicated=dedicated,
        keep=keep,
    )


def _sqlite_engine(url: str, *, writer: bool, busy_timeout_ms: int) -> Engine:
    database = make_url(url).database
    assert database is not None  # normalize_url refused a URL without one
    Path(database).parent.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {
        "connect_args": {"check_same_thread": False, "timeout": busy_timeout_ms / 1000}
    }
    if writer:
        # One connection: see the module docstring (the WAL-reset bug).
        kwargs.update(pool_size=1, max_overflow=0, pool_timeout=60)
    engine = create_engine(url, **kwargs)
    # IMMEDIATE: a write never upgrades a read lock half-way, which SQLite answers with
    # SQLITE_BUSY and no wait.
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
        # Relpaths are case-sensitive, as on PostgreSQL: a prefix "Models/" is not "models/".
        cur.execute("PRAGMA case_sensitive_like=ON")
        cur.close()
        dbapi_conn.create_function("tierd_decay", 4, decay, deterministic=True)

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql(begin)

    return engine


def _postgresql_engine(
    url: str, *, writer: bool, busy_timeout_ms: int, name: str, dedicated: bool, keep: int | None
) -> Engine:
    connect_args: dict[str, Any] = {
        "connect_timeout": 10,
        "application_name": name,
        # A write waits this long for a row another writer holds, then fails (CatalogBusy).
        "options": f"-c lock_timeout={int(busy_timeout_ms)}",
        # A host that vanishes (power, network) must not hold row locks for the kernel's
        # two-hour default: the server drops its session within about a minute.
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
    }
    # The locking above assumes READ COMMITTED whatever the server's default is.
    isolation = "READ COMMITTED" if writer else "AUTOCOMMIT"
    if dedicated:
        return create_engine(
            url, connect_args=connect_args, isolation_level=isolation, poolclass=NullPool
        )
    return create_engine(
        url,
        connect_args=connect_args,
        isolation_level=isolation,
        # A write checks its pooled connection first (one round trip, small beside a commit's
        # WAL flush), so the first write after a server restart does not fail; a read does
        # not (the read path is hot): the first read on a dead connection fails once, and the
        # pool then drops every connection older than that failure.
        pool_pre_ping=writer,
        # Writers: the access flush, the scheduler's moves, the watcher, uploads; readers: the
        # request threads. Each host opens at most 8 + 16 (+ 1 for its lock): a large fleet
        # wants a pooler in front (in session mode for the lock's connection).
        pool_size=keep or (2 if writer else 4),
        max_overflow=6 if writer else 12,
        pool_timeout=30,
    )


def relax_commit(session: Session) -> None:
    """Let this PostgreSQL transaction's commit return before its WAL reaches the disk: for
    writes a crash may lose but never corrupts (access counters, a finished move's ``done``),
    which RELIABILITY.md lets SQLite write with ``synchronous=NORMAL``. Other transactions'
    durability is untouched, and the order of commits is kept."""
    session.execute(text("SET LOCAL synchronous_commit = off"))


def decayed_heat(
    dialect: str, heat: ColumnElement[float], heat_at: ColumnElement[float]
) -> ColumnElement[float]:
    """SQL for ``decay(heat, heat_at, :now, :hl)`` on ``dialect``, with bind parameters ``now``
    and ``hl``; the same numbers as :func:`decay`."""
    now = bindparam("now", type_=Float)
    hl = bindparam("hl", type_=Float)
    if dialect == SQLITE:
        return func.tierd_decay(heat, heat_at, now, hl, type_=Float)
    # decay() reads a heat_at of 0 as "now", like NULL.
    dt = func.greatest(0.0, now - func.coalesce(func.nullif(heat_at, 0.0), now))
    return case(
        (heat.is_(None), 0.0),
        (heat == 0.0, 0.0),
        (hl <= 0.0, heat),
        # 2^-1000 is 0 in a float; PostgreSQL raises an underflow where C returns 0.
        (dt / hl > 1000.0, 0.0),
        else_=heat * func.power(2.0, -dt / hl),
    )
