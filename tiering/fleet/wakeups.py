"""Wake-ups for fleet jobs: PostgreSQL's ``LISTEN``/``NOTIFY``, so each host starts its task as
soon as a job is created instead of at its next poll.

A new job's transaction sends ``NOTIFY tierd_fleet_jobs`` (delivered when it commits, never for
a job rolled back); each host's worker waits on a connection of its own that ``LISTEN``\\s, with
its poll interval as the timeout. Polling stays the mechanism that is always right (a
notification sent while a host was down or reconnecting is simply missed, and its next poll
finds the task); the notification only makes it prompt. On SQLite (one host) the worker just
sleeps its poll interval: the host that creates a job runs it, and is woken directly.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from tiering.catalog.db import Database

__all__ = ["CHANNEL", "JobWakeups", "notify_new_job"]

log = logging.getLogger(__name__)

CHANNEL = "tierd_fleet_jobs"
#: How long a host polls only, after its listening connection failed, before it tries again.
RECONNECT_S = 5.0


def notify_new_job(s: Session, db: Database, job_id: int) -> None:
    """Within the job's transaction: tell listening hosts once it commits."""
    if not db.single_writer:
        s.execute(text("SELECT pg_notify(:c, :p)"), {"c": CHANNEL, "p": str(job_id)})


class JobWakeups:
    """One host's wait for new fleet jobs (see the module docstring).

    :meth:`wait` returns when a job was created anywhere in the fleet, when :meth:`poke` is
    called (a job created on this host), when ``stop`` is set, or after ``timeout``.
    """

    def __init__(self, db: Database) -> None:
        self.db = db
        self._poked = threading.Event()
        self._conn: Any = None
        self._broken = False
        self._retry_at = 0.0  # no new connection before this (monotonic): not one per step

    def poke(self) -> None:
        self._poked.set()

    def wait(self, timeout: float, stop: threading.Event) -> bool:
        """Wait (see the class docstring); True when woken by a new job or a poke."""
        deadline = time.monotonic() + timeout
        woken = False
        while not stop.is_set() and not (woken := self._poked.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # Short steps, so that a poke or a stop is seen soon.
            step = min(left, 0.25)
            conn = None if self.db.single_writer else self._listening()
            if conn is None:
                self._poked.wait(min(step, 0.05))
                continue
            try:
                # stop_after=1: back at the first notification, else after ``step``.
                if any(True for _ in conn.notifies(timeout=step, stop_after=1)):
                    woken = True
                    break
            except Exception as exc:
                self._drop(exc)
        self._poked.clear()
        return woken

    def _listening(self) -> Any:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        if time.monotonic() < self._retry_at:
            return None
        try:
            import psycopg

            url = make_url(self.db.url).set(drivername="postgresql")
            conn = psycopg.connect(
                url.render_as_string(hide_password=False),
                autocommit=True,
                connect_timeout=5,
                application_name="tierd-fleet-listen",
            )
            conn.execute(f"LISTEN {CHANNEL}")
        except Exception as exc:
            self._drop(exc)
            return None
        if self._broken:
            log.info("fleet jobs: listening for new jobs again")
        self._conn, self._broken = conn, False
        return conn

    def _drop(self, exc: BaseException) -> None:
        if not self._broken:
            log.info("fleet jobs: not listening for new jobs (%s); polling", exc)
        self._broken = True
        self._retry_at = time.monotonic() + RECONNECT_S
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
