"""A background thread that does one job every so often (or when woken), and stops cleanly."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["Periodic"]

log = logging.getLogger(__name__)


class Periodic:
    """Calls ``fn`` every ``interval_s`` seconds on a daemon thread named ``name``, and soon
    after each :meth:`wake`; with ``interval_s`` None, only when woken.

    An error is logged and the next tick tries again, so a busy catalog or a transient fault
    delays the work instead of ending it. ``stop()`` wakes the thread at once and joins it.
    """

    def __init__(self, fn: Callable[[], object], interval_s: float | None, name: str) -> None:
        self.fn = fn
        self.interval_s = interval_s
        self.name = name
        self._stopped = threading.Event()
        self._wake = threading.Event()  # kept across start(): a wake before it still counts
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopped.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Run ``fn`` soon (once, however many wakes come before it runs)."""
        self._wake.set()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            if self._stopped.is_set():
                return
            self._wake.clear()
            try:
                self.fn()
            except Exception:
                log.exception("%s failed; will retry", self.name)
