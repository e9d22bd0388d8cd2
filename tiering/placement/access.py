"""Access tracking: counted in memory, written to the catalog in batches.

A read only increments a counter under a lock (well over a million a second), so no read ever
waits for SQLite. A background thread flushes the counts every ``interval_s`` and at stop.

A flush that fails (a busy catalog, or PostgreSQL unreachable) puts its counts back, so they
reach the catalog with the next flush that succeeds, counted once. While the catalog stays
unreachable the pending counts are merged per file, and kept to :attr:`AccessTracker.max_files`
files (the most accessed): an outage of any length holds bounded memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable

from tiering.catalog import Catalog
from tiering.errors import CatalogUnreachable
from tiering.periodic import Periodic

__all__ = ["AccessTracker"]

log = logging.getLogger(__name__)


class AccessTracker:
    #: The most files whose counts wait for the catalog; past it the least accessed are dropped
    #: (their heat is then a little low, which a policy tolerates: it is a decayed estimate).
    max_files = 1_000_000

    def __init__(self, catalog: Catalog, *, half_life_s: float, interval_s: float = 1.0) -> None:
        self.catalog = catalog
        self.half_life_s = half_life_s
        self._pending: Counter[int] = Counter()
        self._lock = threading.Lock()
        # Held across a whole flush, so flush() returns only once every access recorded before
        # it is in the catalog, even while the background thread is half-way through its own.
        self._flush_lock = threading.Lock()
        self._ticker = Periodic(self._flush_quietly, interval_s, "tierd-access-flush")
        self._unreachable = False  # the last background flush found the catalog unreachable
        self.dropped = 0  # counts dropped past max_files since start

    def record(self, file_id: int, n: int = 1) -> None:
        """Count ``n`` accesses of a file (cheap; never touches the catalog)."""
        with self._lock:
            self._pending[file_id] += n

    def record_many(self, file_ids: Iterable[int]) -> None:
        with self._lock:
            self._pending.update(file_ids)

    def pending(self) -> int:
        with self._lock:
            return sum(self._pending.values())

    def flush(self, now: float | None = None) -> int:
        """Write the counted accesses; returns how many files were updated."""
        with self._flush_lock:
            with self._lock:
                batch, self._pending = self._pending, Counter()
            if not batch:
                return 0
            try:
                self.catalog.record_accesses(
                    batch, now=time.time() if now is None else now, half_life_s=self.half_life_s
                )
            except Exception:
                # Put them back so a busy catalog delays the counts instead of losing them.
                with self._lock:
                    self._pending.update(batch)
                    self._bound()
                raise
            return len(batch)

    def _bound(self) -> None:
        """Keep the pending counts to ``max_files`` files (called holding the lock)."""
        excess = len(self._pending) - self.max_files
        if excess <= 0:
            return
        kept = Counter(dict(self._pending.most_common(self.max_files)))
        lost = sum(self._pending.values()) - sum(kept.values())
        self._pending = kept
        self.dropped += lost
        log.warning(
            "%d accesses of %d files dropped: more than %d files waited for the catalog",
            lost,
            excess,
            self.max_files,
        )

    def _flush_quietly(self) -> None:
        """The background flush: an unreachable catalog is logged when it starts and ends
        (the database logs why), not every second."""
        try:
            flushed = self.flush()
        except CatalogUnreachable:
            if not self._unreachable:
                log.warning("access counts are kept in memory until the catalog answers again")
            self._unreachable = True
            return
        if flushed and self._unreachable:  # (nothing pending proves nothing)
            log.warning("the access counts kept while the catalog was unreachable are written")
            self._unreachable = False

    def start(self) -> None:
        self._ticker.start()

    def stop(self) -> None:
        """Stop the thread and flush what is left."""
        self._ticker.stop()
        self.flush()
