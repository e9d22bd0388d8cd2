"""One serving process per catalog: an exclusive ``flock`` on a file beside the database."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from sqlalchemy.engine import make_url

from tiering.errors import Unavailable

__all__ = ["CatalogLock"]


class CatalogLock:
    """An exclusive lock on ``<database>.lock``, taken without waiting.

    ``flock`` rather than a pid file: the kernel drops the lock when the holder dies, so a crash
    never leaves a stale lock for the next start to argue with.
    """

    def __init__(self, catalog_url: str) -> None:
        # The URL is parsed when the lock is taken, so a bad one fails at start, not here.
        self.catalog_url = catalog_url
        self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def acquire(self) -> None:
        """Take the lock.

        Raises
        ------
        Unavailable
            Another process (or another engine in this one) holds it.
        """
        db_path = Path(make_url(self.catalog_url).database or "catalog.db")
        db_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{db_path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Unavailable(f"another tierd is already serving the catalog {db_path}") from None
        self._fd = fd

    def release(self) -> None:
        """Let go of the lock (closing the fd drops it); a no-op when not held."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
