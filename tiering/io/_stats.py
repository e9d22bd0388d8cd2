"""I/O reports and statistics, broken down per I/O path and per tier.

Units: bandwidths are GB/s with 1 GB = 10**9 bytes (the seed's draft computed Gbit/s; tierd
reports bytes so they compare with the device README and ``tierd bench``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = [
    "GdsStatsSnapshot",
    "IoPath",
    "IoReport",
    "LoadSource",
    "PathStats",
    "SOURCES",
    "Stats",
    "UNTIERED",
]

IoPath = Literal["gds", "compat", "host", "remote", "copy"]
"""Which path moved the bytes.

``gds``: cuFile direct storage → GPU DMA (KvikIO, nvidia-fs). ``compat``: KvikIO's POSIX path
through pinned bounce buffers. ``host``: tierd's own parallel ``preadv`` into host memory,
followed by one host → device copy when the target is a GPU. ``remote``: ranged reads of a file
that is not on a local disk (an object-store tier): straight into host memory, or through
pinned staging pieces copied to the GPU (see :mod:`tiering.io._remote`). ``copy``: the bytes
were already in memory (a memory tier's pinned host copy, or a copy resident on a GPU): one
``cudaMemcpy`` host → device, device → device or peer, or a ``memcpy`` on the host (see
:mod:`tiering.io._copies`).
"""

LoadSource = Literal["gpu", "peer", "memory", "page_cache", "storage", "object_store"]
"""Where a read's bytes came from, fastest first.

``gpu``: a copy already on the target GPU (or, for a ``cpu`` target, on a GPU). ``peer``: a
copy held by a peer: another GPU of the host, copied over NVLink or PCIe (I/O path ``copy``),
or another host of the fleet, read over its peer route (I/O path ``remote``). ``memory``: a
memory tier's pinned host copy. ``page_cache``: a local file whose pages were cached (reads of
1 MiB or less are not probed and count here). ``storage``: a local file read cold from its disk.
``object_store``: ranged GETs of an object-store tier.
"""

SOURCES: tuple[str, ...] = ("gpu", "peer", "memory", "page_cache", "storage", "object_store")

UNTIERED = "untiered"
"""The tier key of files that lie under no tier root."""


@dataclass(frozen=True)
class IoReport:
    """What one call did: bytes moved, the path it took, the tier it read, and how fast."""

    nbytes: int
    io_path: IoPath
    tier: str
    seconds: float
    cold: bool = False
    #: The engine that moved the bytes where a path has several: ``remote`` reads are
    #: ``"kvikio"`` (KvikIO's RemoteFile) or ``"python"`` (tierd's ranged GETs); else None.
    engine: str | None = None
    #: Where the bytes came from (see :data:`LoadSource`).
    source: LoadSource = "page_cache"
    #: False for copies queued under a :class:`~tiering.io.fences.Fence` that had not landed
    #: when the report was made: ``seconds`` then timed the queueing alone.
    landed: bool = True

    @property
    def gbps(self) -> float:
        """Bandwidth of this call in GB/s (10**9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __int__(self) -> int:  # the seed's load_to_gpu returns the byte count
        return self.nbytes


@dataclass(frozen=True)
class PathStats:
    """Counters of one slice of the traffic (all of it, one path, or one tier)."""

    bytes_transferred: int = 0
    operations_completed: int = 0
    operations_failed: int = 0
    peak_bandwidth_gbps: float = 0.0
    avg_latency_us: float = 0.0
    effective_bandwidth_gbps: float = 0.0


@dataclass(frozen=True)
class GdsStatsSnapshot(PathStats):
    """A consistent copy of the counters.

    ``effective_bandwidth_gbps`` is bytes over the time at least one operation was in flight
    (not over the sum of their durations, which would undercount concurrent loads).
    ``peak_bandwidth_gbps`` is the fastest single operation of at least 1 MiB (smaller ones
    measure latency, not bandwidth). ``by_path``, ``by_tier`` and ``by_source`` hold the same
    fields per I/O path, per tier name and per :data:`LoadSource`; ``by_tier_source`` per
    ``"<tier>/<source>"``.
    """

    by_path: dict[str, PathStats] = field(default_factory=dict)
    by_tier: dict[str, PathStats] = field(default_factory=dict)
    by_source: dict[str, PathStats] = field(default_factory=dict)
    by_tier_source: dict[str, PathStats] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_PEAK_MIN_BYTES = 1 << 20


class _Counter:
    __slots__ = ("nbytes", "ok", "failed", "peak", "latency_s", "active", "busy_s", "since")

    def __init__(self) -> None:
        self.nbytes = 0
        self.ok = 0
        self.failed = 0
        self.peak = 0.0
        self.latency_s = 0.0
        self.active = 0
        self.busy_s = 0.0
        self.since = 0.0

    def begin(self, now: float) -> None:
        if self.active == 0:
            self.since = now
        self.active += 1

    def end(self, now: float, nbytes: int, seconds: float, ok: bool) -> None:
        self.active -= 1
        if self.active == 0:
            self.busy_s += now - self.since
        if not ok:
            self.failed += 1
            return
        self.ok += 1
        self.nbytes += nbytes
        self.latency_s += seconds
        if nbytes >= _PEAK_MIN_BYTES and seconds > 0:
            self.peak = max(self.peak, nbytes / seconds / 1e9)

    def snapshot(self, now: float) -> PathStats:
        busy = self.busy_s + (now - self.since if self.active else 0.0)
        return PathStats(
            bytes_transferred=self.nbytes,
            operations_completed=self.ok,
            operations_failed=self.failed,
            peak_bandwidth_gbps=self.peak,
            avg_latency_us=self.latency_s / self.ok * 1e6 if self.ok else 0.0,
            effective_bandwidth_gbps=self.nbytes / busy / 1e9 if busy > 0 else 0.0,
        )


class Stats:
    """Thread-safe counters; one lock, held for a few additions per operation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._total = _Counter()
        self._paths: dict[str, _Counter] = {}
        self._tiers: dict[str, _Counter] = {}
        self._sources: dict[str, _Counter] = {}
        self._tier_sources: dict[str, _Counter] = {}
        self._by_key: dict[tuple[str, str, str], tuple[_Counter, ...]] = {}

    def _counters(self, io_path: str, tier: str, source: str) -> tuple[_Counter, ...]:
        # Cached per key: this runs twice per 4 KiB read, so no allocation here.
        key = (io_path, tier, source)
        found = self._by_key.get(key)
        if found is None:
            found = (
                self._total,
                self._paths.setdefault(io_path, _Counter()),
                self._tiers.setdefault(tier, _Counter()),
                self._sources.setdefault(source, _Counter()),
                self._tier_sources.setdefault(f"{tier}/{source}", _Counter()),
            )
            self._by_key[key] = found
        return found

    def begin(self, io_path: str, tier: str, source: str = "page_cache") -> float:
        """Mark an operation as started; returns its start time for :meth:`end`."""
        now = time.perf_counter()
        with self._lock:
            for c in self._counters(io_path, tier, source):
                c.begin(now)
        return now

    def end(
        self,
        io_path: str,
        tier: str,
        started: float,
        nbytes: int,
        ok: bool,
        source: str = "page_cache",
    ) -> float:
        """Mark an operation as finished (with the ``source`` :meth:`begin` was given);
        returns its duration in seconds."""
        now = time.perf_counter()
        seconds = now - started
        with self._lock:
            for c in self._counters(io_path, tier, source):
                c.end(now, nbytes, seconds, ok)
        return seconds

    def snapshot(self) -> GdsStatsSnapshot:
        now = time.perf_counter()
        with self._lock:
            total = self._total.snapshot(now)
            by_path = {k: v.snapshot(now) for k, v in sorted(self._paths.items())}
            by_tier = {k: v.snapshot(now) for k, v in sorted(self._tiers.items())}
            by_source = {k: v.snapshot(now) for k, v in sorted(self._sources.items())}
            by_ts = {k: v.snapshot(now) for k, v in sorted(self._tier_sources.items())}
        return GdsStatsSnapshot(
            **asdict(total),
            by_path=by_path,
            by_tier=by_tier,
            by_source=by_source,
            by_tier_source=by_ts,
        )

    def reset(self) -> None:
        """Zero every counter. Operations in flight are counted afresh when they end."""
        now = time.perf_counter()
        with self._lock:
            groups = (self._paths, self._tiers, self._sources, self._tier_sources)
            active = [[(k, c.active) for k, c in g.items() if c.active] for g in groups]
            total_active = self._total.active
            self._reset()
            # Keep the in-flight counts so that their end() calls stay balanced.
            self._total.active, self._total.since = total_active, now
            fresh = (self._paths, self._tiers, self._sources, self._tier_sources)
            for group, kept in zip(fresh, active, strict=True):
                for k, n in kept:
                    group[k] = c = _Counter()
                    c.active, c.since = n, now
