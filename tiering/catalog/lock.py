"""One serving process per catalog and host: who may run recovery, moves and scans on it.

- **SQLite**: an exclusive ``flock`` on ``<database>.lock``. The catalog is one host's, and
  two processes writing it is what RELIABILITY.md rules out.
- **PostgreSQL**: many hosts share the catalog, one tierd each. The lock is a session-level
  advisory lock keyed by a hash of the engine's ``host_id``, held by a connection of its own:
  a second tierd with the *same* host id on the same database is refused, any other host is
  not.

Both are dropped by the kernel or the server when the holder dies (its fd closes, its session
ends), so a crash never leaves a stale lock for the next start to argue with. A PostgreSQL
session outlives its host by the TCP keepalive time at most (about a minute; see
:mod:`tiering.catalog.backends`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path

from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from tiering.catalog.backends import SQLITE, backend_of, make_engine, redact
from tiering.errors import Unavailable

__all__ = ["CatalogLock", "host_lock_key"]


def host_lock_key(host_id: str) -> int:
    """The advisory lock key of ``host_id``: 64 bits of a hash (PostgreSQL's bigint), so two
    host ids share a key with odds of about one in 10**19."""
    digest = hashlib.blake2b(f"tierd host {host_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class CatalogLock:
    """The catalog's serving lock for ``host_id``, taken without waiting.

    Parameters
    ----------
    catalog_url:
        The catalog; it is parsed when the lock is taken, so a bad one fails at start.
    host_id:
        Whose lock it is, on PostgreSQL (SQLite's is the host's anyway).
    """

    def __init__(self, catalog_url: str, host_id: str = "") -> None:
        self.catalog_url = catalog_url
        self.host_id = host_id
        self._fd = -1
        self._engine: Engine | None = None
        self._conn: Connection | None = None

    @property
    def held(self) -> bool:
        return self._fd >= 0 or self._conn is not None

    def acquire(self) -> None:
        """Take the lock.

        Raises
        ------
        Unavailable
            Another process (or another engine in this one) holds it, or PostgreSQL cannot be
            reached.
        InvalidInput
            The catalog URL is not one tierd supports.
        """
        if backend_of(self.catalog_url) == SQLITE:
            self._acquire_file()
        else:
            self._acquire_advisory()

    def _acquire_file(self) -> None:
        db_path = Path(make_url(self.catalog_url).database or "catalog.db")
        db_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{db_path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Unavailable(f"another tierd is already serving the catalog {db_path}") from None
        self._fd = fd

    def _acquire_advisory(self) -> None:
        where = redact(self.catalog_url)
        # A connection of its own, outside any pool: the lock lives exactly as long as it.
        name = f"tierd lock {self.host_id}"[:63]
        engine = make_engine(self.catalog_url, writer=True, name=name, dedicated=True)
        try:
            conn = engine.connect()
            got = conn.execute(
                text("SELECT pg_try_advisory_lock(:key)"), {"key": host_lock_key(self.host_id)}
            ).scalar_one()
            conn.commit()  # the lock is the session's, not the transaction's
        except DBAPIError as exc:
            engine.dispose()
            reason = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
            raise Unavailable(f"cannot reach the catalog database {where}: {reason}") from exc
        if not got:
            conn.close()
            engine.dispose()
            raise Unavailable(
                f"another tierd with host id {self.host_id!r} is already serving the catalog "
                f"{where}; give each host its own host_id"
            )
        self._engine, self._conn = engine, conn

    def release(self) -> None:
        """Let go of the lock (closing the fd or the session drops it); a no-op when not held."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._conn is not None:
            conn, engine, self._conn, self._engine = self._conn, self._engine, None, None
            with contextlib.suppress(DBAPIError):  # the server is gone, and the lock with it
                conn.close()
            if engine is not None:
                engine.dispose()
