"""What concurrent moves share: the claim handed to a worker, per-file guards, the bandwidth
cap, and the board of bytes copied so far.

The threads that run moves belong to the scheduler and the engine; this module only holds the
thread-safe pieces they and the mover meet at.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from tiering.catalog import FileRecord, Migration
from tiering.errors import FileBusy

__all__ = [
    "Claim",
    "FileGuards",
    "Progress",
    "ProgressBoard",
    "RateLimiter",
    "ServingGate",
    "lower_priority",
]

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
"""A move's progress callback: ``(bytes copied so far, file size)``."""


@dataclass
class Claim:
    """A claimed move: the intent is written, the file is ``migrating`` and guarded."""

    intent: Migration
    record: FileRecord
    done: threading.Event = field(default_factory=threading.Event)
    result: Migration | None = None
    error: BaseException | None = None
    #: Seconds of the move's last steps not rested for yet (see :class:`ServingGate`): rested
    #: after the file's guard is let go, so the file is not busy meanwhile.
    owed_rest_s: float = 0.0


class FileGuards:
    """In-process exclusion per file id between the mover, uploads and deletes.

    The catalog's compare-and-set serialises changes durably; the guard keeps a publish or a
    delete from landing between a move's switch and its source unlink, where the CAS alone would
    let the mover unlink bytes that just arrived. Holding is never blocking: a busy file is
    :class:`FileBusy` (409) at once.
    """

    def __init__(self) -> None:
        # What each holder is doing, so a refusal says why (a move, an overwrite, a delete).
        self._held: dict[int, str] = {}
        self._lock = threading.Lock()

    def acquire(self, file_id: int, doing: str = "migrated") -> None:
        """Take the file's guard for work described by ``doing`` ("migrated", "overwritten",
        "deleted"); :class:`FileBusy` naming the holder's work if another holds it."""
        with self._lock:
            held = self._held.get(file_id)
            if held is not None:
                raise FileBusy(f"file {file_id} is being {held}; try again", file_id=file_id)
            self._held[file_id] = doing

    def release(self, file_id: int) -> None:
        with self._lock:
            self._held.pop(file_id, None)

    @contextmanager
    def hold(self, file_id: int, doing: str = "migrated") -> Iterator[None]:
        self.acquire(file_id, doing)
        try:
            yield
        finally:
            self.release(file_id)

    def __contains__(self, file_id: object) -> bool:
        with self._lock:
            return file_id in self._held


class RateLimiter:
    """A byte-rate cap shared by every migration (None: no cap); waits are interruptible."""

    BURST_S = 0.05

    def __init__(self, bytes_per_s: float | None = None) -> None:
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def set_rate(self, bytes_per_s: float | None) -> None:
        with self._lock:
            self.rate = bytes_per_s
            self._next = time.monotonic()

    def hold(self) -> None:
        """The time just passed earns no burst: a move rested to yield to serving, and the cap
        must not give that time back to the next chunk (it did: rests under a cap slowed
        moves by 1.05-1.13x, not the gate's 1.3x)."""
        with self._lock:
            if self.rate:
                self._next = max(self._next, time.monotonic() + self.BURST_S)

    def acquire(self, n: int, cancel: threading.Event | None = None) -> None:
        with self._lock:
            if not self.rate:
                return
            now = time.monotonic()
            # A virtual clock: each caller books its bytes' share of time after the last one.
            self._next = max(self._next, now - self.BURST_S) + n / self.rate
            delay = self._next - now - self.BURST_S
        if delay > 0:
            if cancel is not None:
                cancel.wait(delay)
            else:
                time.sleep(delay)


class ServingGate:
    """Moves yield to serving: while requests are being served, a move rests after each chunk
    it copies, and once at its end for its other steps, ``share`` times as long as it worked.

    A move's work competes with serving for what a small host has little of: the cores (the
    page-cache copies, the hash, the catalog's commits and fsyncs) and the server's GIL, which
    its event loop needs for every request (``tierd bench serving``: with 16 client processes
    on 2 cores, moves cost a fifth of the requests). The copy thread's lower CPU priority does
    not give it back: the kernel's writeback and the move's other steps run at the process's.
    Resting does, whatever the resource: a move takes at most ``1 + share`` times as long while
    serving is busy (1.25 times by default, within issue 43's 1.5 with room for what the
    busy cores cost it too; each rest at most ``MAX_REST_S``), and runs at full speed
    otherwise. Under a bandwidth cap the rest follows the cap's wait and counts it (see
    :meth:`~tiering.moves.copying.Pace.after_chunk`).

    Serving calls :meth:`touch` as each request opens a file (one float stored, no lock: the
    request path pays nothing measurable); a request within the last ``active_s`` means busy.
    """

    SHARE = 0.25
    ACTIVE_S = 0.25
    MAX_REST_S = 0.5

    def __init__(self, share: float = SHARE, active_s: float = ACTIVE_S) -> None:
        self.share = share
        self.active_s = active_s
        self._last = float("-inf")  # time.monotonic() of the latest request
        self._lock = threading.Lock()
        #: Rests taken so far, and their seconds (what a test or a debugger looks at).
        self.rests = 0
        self.rested_s = 0.0

    def touch(self) -> None:
        """A request is being served now."""
        self._last = time.monotonic()

    def busy(self) -> bool:
        """Whether a request was served within the last ``active_s``."""
        return time.monotonic() - self._last < self.active_s

    def rest(self, worked_s: float, cancel: threading.Event | None = None) -> float:
        """After ``worked_s`` seconds of a move's work: rest while serving is busy; returns the
        seconds rested (0 when idle). ``cancel`` cuts the rest short."""
        if self.share <= 0 or worked_s <= 0 or not self.busy():
            return 0.0
        delay = min(self.MAX_REST_S, worked_s * self.share)
        with self._lock:
            self.rests += 1
            self.rested_s += delay
        if cancel is not None:
            cancel.wait(delay)
        else:
            time.sleep(delay)
        return delay


class ProgressBoard:
    """Bytes copied so far per in-flight intent id, written by movers and read by the API."""

    def __init__(self) -> None:
        self._copied: dict[int, int] = {}
        self._lock = threading.Lock()

    def set(self, intent_id: int, copied: int) -> None:
        with self._lock:
            self._copied[intent_id] = copied

    def get(self, intent_id: int) -> int | None:
        with self._lock:
            return self._copied.get(intent_id)

    def pop(self, intent_id: int) -> None:
        with self._lock:
            self._copied.pop(intent_id, None)

    def snapshot(self) -> dict[int, int]:
        with self._lock:
            return dict(self._copied)


def lower_priority(native_id: int | None, steps: int) -> int | None:
    """Make thread ``native_id`` ``steps`` nice levels nicer (at most 19); returns its nice
    value, or None where a thread's priority cannot be set alone (not Linux) or the call failed.

    Linux schedules threads one by one, and ``setpriority`` on a thread id sets that thread
    only. Call it from another thread, as the caller holds the GIL and the target therefore
    does not: a thread whose priority falls while it holds the GIL may lose its core on the
    spot and stall every thread of the process until it runs again. A thread can never be
    made less nice again without privilege, so only threads that exist for background work (a
    move's copy) are lowered. Best effort: a failure leaves the thread as it was.
    """
    if native_id is None or steps <= 0 or not sys.platform.startswith("linux"):
        # Elsewhere PRIO_PROCESS with a thread id would name a process, perhaps another one.
        return None
    try:
        now = os.getpriority(os.PRIO_PROCESS, native_id)
        target = min(19, now + steps)
        if target > now:
            os.setpriority(os.PRIO_PROCESS, native_id, target)
        return target
    except OSError as exc:
        log.debug("could not lower the priority of thread %d: %s", native_id, exc)
        return None
