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

A PostgreSQL restart ends every session, so the holder loses its lock while it keeps running:
:meth:`CatalogLock.verify` takes it again (the :class:`~tiering.catalog.db.Database` calls it
before its first write after an outage). When another tierd with the same host id took it
meanwhile, ``verify`` says so and names the holder, and that process stops writing. A session
of this very process that PostgreSQL still keeps (the network, not the server, failed) holds the
lock under this process's token: it is ended and the lock taken again, not mistaken for
another process's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
import uuid
from pathlib import Path

from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

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
        # Names this process's lock sessions, so a session of ours that outlived its connection
        # (see verify) is told apart from another process's.
        self._token = uuid.uuid4().hex[:12]
        #: Who holds the lock instead of this process, once :meth:`verify` found it taken.
        self.holder: str | None = None

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
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            who = f"another tierd (pid {holder})" if holder.isdigit() else "another tierd"
            raise Unavailable(f"{who} is already serving the catalog {db_path}") from None
        # The holder's pid, for the message above: a second start names the process to stop.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def _acquire_advisory(self) -> None:
        if not self._try_advisory():
            raise Unavailable(
                f"another tierd with host id {self.host_id!r} is already serving the catalog "
                f"{redact(self.catalog_url)} ({self.holder}); give each host its own host_id"
            )

    def _try_advisory(self) -> bool:
        """Take the advisory lock on a new session of its own; False (and :attr:`holder` set)
        when another session holds it. Raises Unavailable when PostgreSQL cannot be reached."""
        where = redact(self.catalog_url)
        # A connection of its own, outside any pool: the lock lives exactly as long as it.
        name = f"tierd lock {self._token} {self.host_id}"[:63]
        engine = make_engine(self.catalog_url, writer=True, name=name, dedicated=True)
        key = host_lock_key(self.host_id)
        try:
            conn = engine.connect()
            got = conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": key}).scalar()
            if not got:
                self.holder = self._holder(conn, key)
            conn.commit()  # the lock is the session's, not the transaction's
        except DBAPIError as exc:
            engine.dispose()
            reason = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
            raise Unavailable(f"cannot reach the catalog database {where}: {reason}") from exc
        if not got:
            conn.close()
            engine.dispose()
            return False
        self._engine, self._conn, self.holder = engine, conn, None
        return True

    def _holder(self, conn: Connection, key: int) -> str:
        """Who holds ``key`` (pg_locks shows a bigint key as two oids); ends a session of this
        process's own that outlived its connection, and says so with ``"ours"``."""
        row = conn.execute(
            text(
                "SELECT a.pid, a.application_name, a.client_addr::text, a.backend_start "
                "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
                "AND l.classid = CAST(:hi AS oid) AND l.objid = CAST(:lo AS oid)"
            ),
            {"hi": (key >> 32) & 0xFFFFFFFF, "lo": key & 0xFFFFFFFF},
        ).first()
        if row is None:
            return "a session that has just ended"
        if self._token in (row.application_name or ""):
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": row.pid})
            return "ours"
        return (
            f"PostgreSQL session {row.pid} from {row.client_addr or 'a local socket'}, "
            f"started {row.backend_start:%Y-%m-%d %H:%M:%S %Z}"
        )

    def verify(self) -> bool:
        """Whether this process still holds the lock, taking it again where PostgreSQL dropped
        it (a restart ends every session); SQLite's ``flock`` is never dropped.

        Returns
        -------
        bool
            False when another process holds it now (:attr:`holder` says who); this process
            must then stop writing the catalog for its host.

        Raises
        ------
        Unavailable
            PostgreSQL cannot be reached (nothing is known; ask again later).
        """
        if self._fd >= 0:
            return True
        if self._conn is not None:
            try:
                self._conn.execute(text("SELECT 1")).scalar()
                self._conn.commit()
                return True  # the session lives, and its lock with it
            except DBAPIError:
                self.release()  # that session is gone, and the lock with it
        for _ in range(20):
            if self._try_advisory():
                return True
            if self.holder != "ours":
                return False
            time.sleep(0.05)  # our own stale session was just told to end; its lock goes with it
        return False

    def release(self) -> None:
        """Let go of the lock (closing the fd or the session drops it); a no-op when not held."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._conn is not None:
            conn, engine, self._conn, self._engine = self._conn, self._engine, None, None
            # Any failure here means the session is gone or broken: the lock goes with it.
            with contextlib.suppress(SQLAlchemyError):
                # Unlocked before the session closes: a closed session's backend lets go of
                # its locks only when it exits, a moment later on a busy server, and a tierd
                # started at once after this one would find its host id still held.
                key = host_lock_key(self.host_id)
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
                conn.commit()
            with contextlib.suppress(DBAPIError):
                conn.close()
            if engine is not None:
                engine.dispose()
