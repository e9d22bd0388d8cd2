"""Access tracking: counted in memory, written to the catalog in batches.

A read only increments a counter under a lock (well over a million a second), so no read ever
waits for SQLite. A background thread flushes the counts every ``interval_s`` and at stop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable

from tiering.catalog import Catalog
from tiering.periodic import Periodic

__all__ = ["AccessTracker"]

log = logging.getLogger(__name__)


class AccessTracker:
    def __init__(self, catalog: Catalog, *, half_life_s: float, interval_s: float = 1.0) -> None:
        self.catalog = catalog
        self.half_life_s = half_life_s
        self._pending: Counter[int] = Counter()
        self._lock = threading.Lock()
        # Held across a whole flush, so flush() returns only once every access recorded before
        # it is in the catalog, even while the background thread is half-way through its own.
        self._flush_lock = threading.Lock()
        self._ticker = Periodic(self.flush, interval_s, "tierd-access-flush")

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
                raise
            return len(batch)

    def start(self) -> None:
        self._ticker.start()

    def stop(self) -> None:
        """Stop the thread and flush what is left."""
        self._ticker.stop()
        self.flush()
