"""The memory tier: copies of files in pinned host memory, above every storage tier.

It is a cache, not a :class:`~tiering.tiers.Tier`. A tier holds a file's authoritative bytes
and a move switches that authority; the memory tier only ever holds copies, each of a file that
stays on its storage tier. So scan, the watcher, moves and uploads never see it, the catalog
never names it as a file's tier, and a crash, an OOM kill or a restart loses nothing: memory
is simply empty again.

A copy is named by its content: file id and catalog generation (every change of a file's
place or content bumps it), with the :class:`~tiering.tiers.Stat` of the authoritative file
it was read from and the checksum of the bytes read. Each copy is one page-locked allocation
(:mod:`tiering.tiers._pinned`), made when it is filled and reused by every load until dropped.

Life of a copy: :meth:`MemoryTier.reserve` books its bytes under the quota (evicting colder
copies that no load holds, or refusing), :meth:`MemoryTier.fill` reads the file in,
:meth:`MemoryTier.commit` makes it visible (or :meth:`MemoryTier.abort` frees it). A load
:meth:`MemoryTier.acquire`\\ s it (which pins it and marks its use) and releases it when done.
:meth:`MemoryTier.drop` hides it at once; its memory goes back when the last load releases it,
never under a load. What the catalog says about copies is its owner's business: ``on_drop``
tells the owner each copy that is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from tiering.config import TierConfig
from tiering.errors import FileBusy, InsufficientSpace
from tiering.tiers._base import Source, Stat
from tiering.tiers._memfill import FillCancelled, read_whole
from tiering.tiers._pinned import HostAllocation, allocate, check_budget, default_floor, meminfo

__all__ = ["FillCancelled", "MemoryEntry", "MemoryTier"]

log = logging.getLogger(__name__)

Order = Callable[["MemoryEntry"], float]
"""How cold a copy is (lower: dropped first)."""


@dataclass(eq=False)
class MemoryEntry:
    """One copy of a whole file in pinned host memory."""

    file_id: int
    generation: int
    size: int
    alloc: HostAllocation
    created_at: float = field(default_factory=time.time)
    last_use: float = field(default_factory=time.monotonic)
    #: The authoritative file it was read from, and the checksum of the bytes read.
    stat: Stat | None = None
    checksum: str | None = None
    #: Until then (epoch seconds) the cache planner leaves it alone however cold it is (a
    #: prefetch into memory); memory pressure and a change of the file still drop it.
    keep_until: float = 0.0
    refs: int = 0
    ready: bool = False
    dropped: str | None = None

    @property
    def pinned_memory(self) -> bool:
        """Whether its bytes are page-locked (always, unless the host refused)."""
        return self.alloc.pinned

    def view(self) -> np.ndarray:
        """The bytes, read-only: every load shares them."""
        array = self.alloc.array
        assert array is not None, "a freed copy has no bytes"
        out: np.ndarray = array.view()
        out.flags.writeable = False
        return out


class MemoryTier:
    """Copies of files in pinned host memory, up to ``config.quota_bytes``; see the module
    docstring.

    Parameters
    ----------
    config:
        A ``kind="memory"`` tier with its quota.
    backend:
        ``"cuda"`` (cudaHostAlloc) or ``"mlock"``; None picks by the host
        (:func:`~tiering.tiers._pinned.pinning_backend`).
    floor_bytes:
        MemAvailable under which copies are given back (None: max(1 GiB, 5 % of RAM)).
    on_drop:
        Called with each copy dropped and the reason, after it is hidden (outside the lock).
    """

    kind: ClassVar[str] = "memory"
    #: Above every storage tier (ranked 0..).
    rank: ClassVar[int] = -1

    def __init__(
        self,
        config: TierConfig,
        *,
        backend: str | None = None,
        floor_bytes: int | None = None,
        on_drop: Callable[[MemoryEntry, str], None] | None = None,
    ) -> None:
        if config.quota_bytes is None:
            raise ValueError(f"memory tier {config.name!r} needs quota_bytes")
        self.config = config
        self.name = config.name
        self.quota_bytes: int = config.quota_bytes
        self.backend = backend
        self.floor_bytes = floor_bytes
        self.on_drop = on_drop
        self._lock = threading.Lock()
        self._entries: dict[int, MemoryEntry] = {}  # ready copies, by file id
        self._filling: dict[int, tuple[MemoryEntry, threading.Event]] = {}
        self._lingering: set[MemoryEntry] = set()  # dropped while a load held them
        self._closed = False
        self.fills = 0
        self.drops: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"MemoryTier({self.name!r}, quota={self.quota_bytes})"

    @property
    def location(self) -> str:
        return "pinned host memory"

    def check(self) -> None:
        """The quota against RLIMIT_MEMLOCK and the host's RAM; raises
        :class:`~tiering.errors.TierUnavailable` with the numbers and the fix."""
        check_budget(self.name, self.quota_bytes, self.floor_bytes, self.backend)

    def floor(self) -> int:
        if self.floor_bytes is not None:
            return self.floor_bytes
        return default_floor(meminfo().get("MemTotal", 0))

    # -- what it holds -----------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """Bytes booked: ready copies, fills in flight, and dropped copies a load still holds."""
        with self._lock:
            return self._used()

    def _used(self) -> int:
        return (
            sum(e.size for e in self._entries.values())
            + sum(e.size for e, _ in self._filling.values())
            + sum(e.size for e in self._lingering)
        )

    @property
    def held_bytes(self) -> int:
        """Bytes of the ready copies."""
        with self._lock:
            return sum(e.size for e in self._entries.values())

    def entries(self) -> list[MemoryEntry]:
        """The ready copies (a snapshot)."""
        with self._lock:
            return list(self._entries.values())

    def get(self, file_id: int) -> MemoryEntry | None:
        with self._lock:
            return self._entries.get(file_id)

    def filling(self, file_id: int) -> threading.Event | None:
        """Set when the fill of ``file_id`` in flight ends; None when none is."""
        with self._lock:
            f = self._filling.get(file_id)
            return f[1] if f is not None else None

    # -- filling -----------------------------------------------------------------------------
    def reserve(
        self,
        file_id: int,
        generation: int,
        size: int,
        *,
        order: Order | None = None,
        colder_than: float | None = None,
    ) -> MemoryEntry:
        """Book ``size`` bytes for a copy of ``file_id`` at ``generation`` and allocate them.

        When the quota is short, copies no load holds are dropped coldest first by ``order``
        (default: least recently used), only those below ``colder_than`` when given, and none
        kept by a prefetch; if that cannot make room, nothing is dropped.

        Raises
        ------
        FileBusy
            The file is being filled already.
        InsufficientSpace
            Over the quota (even after eviction), host memory under the pressure floor, or
            the host refused to pin the memory.
        """
        dropped: list[MemoryEntry] = []
        with self._lock:
            if file_id in self._filling:
                raise FileBusy(f"file {file_id} is being copied into memory", file_id=file_id)
            if size > self.quota_bytes:
                raise InsufficientSpace(
                    f"file {file_id} ({size} bytes) is larger than memory tier {self.name}'s "
                    f"quota of {self.quota_bytes} bytes",
                    tier=self.name,
                    size=size,
                )
            avail = meminfo().get("MemAvailable")
            floor = self.floor()
            if avail is not None and avail - size < floor:
                raise InsufficientSpace(
                    f"host memory is low: {avail} bytes available, and a copy of {size} bytes "
                    f"would leave less than the floor of {floor} bytes",
                    tier=self.name,
                    size=size,
                    available_bytes=avail,
                    floor_bytes=floor,
                )
            old = self._entries.get(file_id)
            short = self._used() - (old.size if old is not None and old.refs == 0 else 0)
            short += size - self.quota_bytes
            if short > 0:
                dropped += self._evict(short, order, colder_than, file_id, size)
            if old is not None:
                dropped.append(self._hide(old, "stale"))
            entry = MemoryEntry(file_id, generation, size, HostAllocation(0, "mlock"))
            self._filling[file_id] = (entry, threading.Event())
        self._notify(dropped)
        try:
            entry.alloc = allocate(size, self.backend)
        except BaseException:
            self._end_fill(entry)
            raise
        return entry

    def fill(
        self,
        entry: MemoryEntry,
        source: Source,
        *,
        cancel: threading.Event | None = None,
        throttle: Callable[[int], None] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> str:
        """Read ``source`` (the whole authoritative file) into a reserved ``entry``; returns the
        checksum of the bytes read. Raises FillCancelled or IntegrityError (see
        :func:`~tiering.tiers._memfill.read_whole`)."""
        array = entry.alloc.array
        assert array is not None and not entry.ready
        checksum = read_whole(source, array, cancel=cancel, throttle=throttle, progress=progress)
        entry.stat = source.stat
        entry.checksum = checksum
        return checksum

    def commit(self, entry: MemoryEntry, *, keep_until: float = 0.0) -> MemoryEntry:
        """Make a filled ``entry`` visible to loads. Raises FillCancelled (freeing it) once the
        tier is closed."""
        with self._lock:
            closed = self._closed
            if not closed:
                entry.ready = True
                entry.keep_until = keep_until
                entry.last_use = time.monotonic()
                self._entries[entry.file_id] = entry
                self.fills += 1
        self._end_fill(entry, free=closed)
        if closed:
            raise FillCancelled
        return entry

    def abort(self, entry: MemoryEntry) -> None:
        """Give a reserved entry's memory back (the fill failed or was refused)."""
        self._end_fill(entry)

    def _end_fill(self, entry: MemoryEntry, *, free: bool = True) -> None:
        with self._lock:
            found = self._filling.get(entry.file_id)
            if found is not None and found[0] is entry:
                del self._filling[entry.file_id]
                found[1].set()
        if free:
            entry.alloc.free()

    # -- loads -------------------------------------------------------------------------------
    def acquire(self, file_id: int, generation: int) -> MemoryEntry | None:
        """The copy of ``file_id`` at ``generation``, pinned until :meth:`release`; None when
        there is none. A copy of another generation is stale: it is dropped."""
        with self._lock:
            e = self._entries.get(file_id)
            if e is not None and e.generation == generation:
                e.refs += 1
                e.last_use = time.monotonic()
                return e
            stale = self._hide(e, "stale") if e is not None else None
        if stale is not None:
            self._notify([stale])
        return None

    def release(self, entry: MemoryEntry) -> None:
        with self._lock:
            entry.refs -= 1
            gone = entry.refs == 0 and entry.dropped is not None
            if gone:
                self._lingering.discard(entry)
        if gone:
            entry.alloc.free()  # dropped while this load held it: its memory goes back now

    # -- dropping ----------------------------------------------------------------------------
    def drop(self, file_id: int, reason: str, *, generation: int | None = None) -> bool:
        """Drop the copy of ``file_id`` (only at ``generation``, when given); its memory goes
        back at once, or when the last load holding it releases it."""
        with self._lock:
            e = self._entries.get(file_id)
            if e is None or (generation is not None and e.generation != generation):
                return False
            self._hide(e, reason)
        self._notify([e])
        return True

    def pressure(self) -> int:
        """Bytes to give back for MemAvailable to be at the floor again (0: no pressure)."""
        avail = meminfo().get("MemAvailable")
        return 0 if avail is None else max(0, self.floor() - avail)

    def relieve(self, need: int, order: Order | None = None) -> list[MemoryEntry]:
        """Drop copies no load holds, coldest first by ``order``, until ``need`` bytes are
        freed (or none is left); returns them."""
        with self._lock:
            dropped = self._evict(need, order, None, None, 0, reason="pressure", partial=True)
        self._notify(dropped)
        return dropped

    def clear(self, reason: str = "stop") -> list[MemoryEntry]:
        """Drop every copy (each freed now, or at its last release)."""
        with self._lock:
            dropped = [self._hide(e, reason) for e in list(self._entries.values())]
        self._notify(dropped)
        return dropped

    def _evict(
        self,
        need: int,
        order: Order | None,
        colder_than: float | None,
        file_id: int | None,
        size: int,
        *,
        reason: str = "evicted",
        partial: bool = False,
    ) -> list[MemoryEntry]:
        """Hide the coldest free copies until ``need`` bytes are freed; all or nothing unless
        ``partial`` (called holding the lock)."""
        key: Order = order or (lambda e: e.last_use)
        now = time.time()
        victims = []
        freed = 0
        candidates = [
            e
            for e in self._entries.values()
            if e.refs == 0 and e.file_id != file_id and (partial or e.keep_until <= now)
        ]
        for e in sorted(candidates, key=lambda e: (key(e), e.last_use)):
            if freed >= need:
                break
            if colder_than is not None and key(e) >= colder_than:
                break
            victims.append(e)
            freed += e.size
        if freed < need and not partial:
            raise InsufficientSpace(
                f"memory tier {self.name} is full: {self._used()} of {self.quota_bytes} bytes "
                f"held, and too little of it is colder and unused to make room for "
                f"{'file ' + str(file_id) if file_id is not None else 'the copy'} ({size} bytes)",
                tier=self.name,
                size=size,
                quota_bytes=self.quota_bytes,
            )
        return [self._hide(e, reason) for e in victims]

    def _hide(self, e: MemoryEntry, reason: str) -> MemoryEntry:
        """Take ``e`` out of sight (called holding the lock); freed now when no load holds it,
        else at its last release."""
        if self._entries.get(e.file_id) is e:
            del self._entries[e.file_id]
        e.dropped = reason
        self.drops[reason] = self.drops.get(reason, 0) + 1
        if e.refs > 0:
            self._lingering.add(e)
        else:
            e.alloc.free()
        return e

    def _notify(self, dropped: list[MemoryEntry]) -> None:
        if self.on_drop is None:
            return
        for e in dropped:
            try:
                self.on_drop(e, e.dropped or "dropped")
            except Exception:
                log.exception("memory tier %s: forgetting file %d's copy", self.name, e.file_id)

    def reopen(self) -> None:
        """Take fills again after :meth:`close` (an engine started again)."""
        with self._lock:
            self._closed = False

    def close(self) -> None:
        """Drop every copy (the engine stops); fills still in flight are not committed."""
        with self._lock:
            self._closed = True
        self.clear("stop")
