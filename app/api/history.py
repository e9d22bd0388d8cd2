"""The last hour of load statistics: ``GET /v1/stats/history``.

``/v1/stats`` is cumulative since start (or the last reset), so it cannot say what happened in
the last ten minutes. A :class:`StatsRecorder` samples the loader's counters every minute into
a ring of 61 samples, kept in memory only, and the route turns consecutive samples into
per-minute deltas: bytes, operations, failures, throughput and mean latency, in total, per I/O
path, per tier and per source (where the bytes came from). The last point runs from the newest
sample to now, so loads made a second ago show at once.

The sampling thread belongs to this router's lifespan, which FastAPI nests inside the app's:
it starts after the loader and stops before it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request
from pydantic import BaseModel, Field

from app.api.responses import BUSY, DATA, INVALID
from app.auth import require_data
from app.errors import HttpError
from app.schemas import iso
from tiering.periodic import Periodic

__all__ = [
    "HistoryPoint",
    "HistorySlice",
    "StatsHistory",
    "StatsRecorder",
    "router",
]

STEP_S = 60.0
KEEP_STEPS = 60  # one hour


# -- the ring of samples -------------------------------------------------------------------------
@dataclass(frozen=True)
class _Counts:
    """The additive part of one slice of a stats snapshot (totals since start or reset)."""

    nbytes: int = 0
    ok: int = 0
    failed: int = 0
    latency_s: float = 0.0  # summed over ok operations
    busy_s: float = 0.0  # time with at least one operation in flight (0 when unknown)

    @classmethod
    def of(cls, s: Mapping[str, Any]) -> _Counts:
        ok = int(s.get("operations_completed", 0))
        nbytes = int(s.get("bytes_transferred", 0))
        eff = float(s.get("effective_bandwidth_gbps", 0.0))
        return cls(
            nbytes=nbytes,
            ok=ok,
            failed=int(s.get("operations_failed", 0)),
            latency_s=float(s.get("avg_latency_us", 0.0)) * ok / 1e6,
            busy_s=nbytes / (eff * 1e9) if eff > 0 else 0.0,
        )

    def since(self, before: _Counts | None) -> _Counts:
        """The counts added after ``before``; after a reset (counters went down), all of them."""
        if before is None or self.ok < before.ok or self.failed < before.failed:
            return self
        if self.nbytes < before.nbytes:
            return self
        return _Counts(
            nbytes=self.nbytes - before.nbytes,
            ok=self.ok - before.ok,
            failed=self.failed - before.failed,
            latency_s=max(0.0, self.latency_s - before.latency_s),
            busy_s=max(0.0, self.busy_s - before.busy_s),
        )


@dataclass(frozen=True)
class _Sample:
    at: float  # wall clock
    total: _Counts
    by_path: dict[str, _Counts]
    by_tier: dict[str, _Counts]
    by_source: dict[str, _Counts]

    @classmethod
    def of(cls, at: float, snap: Mapping[str, Any]) -> _Sample:
        return cls(
            at=at,
            total=_Counts.of(snap),
            by_path={k: _Counts.of(v) for k, v in snap.get("by_path", {}).items()},
            by_tier={k: _Counts.of(v) for k, v in snap.get("by_tier", {}).items()},
            by_source={k: _Counts.of(v) for k, v in snap.get("by_source", {}).items()},
        )


class StatsRecorder:
    """Samples ``snapshot()`` (a stats dict as ``GdsStatsSnapshot.to_dict()`` gives) every
    ``step_s`` seconds and keeps the last ``keep`` intervals.

    Parameters
    ----------
    snapshot
        Returns the loader's cumulative counters; called from the sampling thread.
    step_s, keep
        Interval between samples, and how many intervals are kept (one hour by default).
    clock
        Wall clock, seconds since the epoch.
    """

    def __init__(
        self,
        snapshot: Callable[[], Mapping[str, Any]],
        *,
        step_s: float = STEP_S,
        keep: int = KEEP_STEPS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.snapshot = snapshot
        self.step_s = step_s
        self.keep = keep
        self.clock = clock
        self._lock = threading.Lock()
        self._samples: deque[_Sample] = deque(maxlen=keep + 1)
        self._periodic = Periodic(self.sample, step_s, name="tierd-stats-history")

    def start(self) -> None:
        """Take the first sample now, then one every ``step_s`` on a background thread."""
        self.sample()
        self._periodic.start()

    def stop(self) -> None:
        self._periodic.stop()

    def sample(self) -> None:
        s = _Sample.of(self.clock(), self.snapshot())
        with self._lock:
            self._samples.append(s)

    def history(self) -> StatsHistory:
        """Deltas between consecutive samples, oldest first, then the newest sample to now."""
        with self._lock:
            samples = list(self._samples)
        live = _Sample.of(self.clock(), self.snapshot())
        points = [_point(a, b, partial=False) for a, b in zip(samples, samples[1:], strict=False)]
        if samples:
            points.append(_point(samples[-1], live, partial=True))
        since = samples[0].at if samples else live.at
        return StatsHistory(step_s=self.step_s, since=_dt(since), now=_dt(live.at), points=points)


# -- response models -----------------------------------------------------------------------------
class HistorySlice(BaseModel):
    bytes: int = Field(description="Bytes loaded in the interval")
    operations: int = Field(description="Loads completed in the interval")
    failed: int = Field(description="Loads that failed in the interval")
    throughput_bps: float = Field(description="Bytes per second over the whole interval")
    effective_gbps: float = Field(
        description="GB/s (10**9 bytes/s) over the time at least one load was in flight"
    )
    avg_latency_us: float = Field(description="Mean duration of a completed load, in µs")


class HistoryPoint(BaseModel):
    start: datetime
    end: datetime
    seconds: float = Field(description="Length of the interval")
    partial: bool = Field(description="The current interval: from the newest sample to now")
    total: HistorySlice
    by_path: dict[str, HistorySlice] = Field(description="Per I/O path: gds, compat, host")
    by_tier: dict[str, HistorySlice] = Field(description="Per tier name (or 'untiered')")
    by_source: dict[str, HistorySlice] = Field(
        description="Per source: gpu, peer, memory, page_cache, storage, object_store"
    )


class StatsHistory(BaseModel):
    step_s: float = Field(description="Seconds between samples")
    since: datetime = Field(description="The oldest sample kept (server start, or an hour ago)")
    now: datetime
    points: list[HistoryPoint] = Field(description="Oldest first; the last one is partial")


def _dt(ts: float) -> datetime:
    out = iso(ts)
    assert out is not None
    return out


def _slice(c: _Counts, seconds: float) -> HistorySlice:
    return HistorySlice(
        bytes=c.nbytes,
        operations=c.ok,
        failed=c.failed,
        throughput_bps=round(c.nbytes / seconds, 3) if seconds > 0 else 0.0,
        effective_gbps=round(c.nbytes / c.busy_s / 1e9, 6) if c.busy_s > 0 else 0.0,
        avg_latency_us=round(c.latency_s / c.ok * 1e6, 3) if c.ok else 0.0,
    )


def _slices(
    before: dict[str, _Counts], after: dict[str, _Counts], seconds: float
) -> dict[str, HistorySlice]:
    out = {}
    for key, now in after.items():
        d = now.since(before.get(key))
        if d.ok or d.failed or d.nbytes:
            out[key] = _slice(d, seconds)
    return out


def _point(a: _Sample, b: _Sample, *, partial: bool) -> HistoryPoint:
    seconds = max(0.0, b.at - a.at)
    return HistoryPoint(
        start=_dt(a.at),
        end=_dt(b.at),
        seconds=round(seconds, 3),
        partial=partial,
        total=_slice(b.total.since(a.total), seconds),
        by_path=_slices(a.by_path, b.by_path, seconds),
        by_tier=_slices(a.by_tier, b.by_tier, seconds),
        by_source=_slices(a.by_source, b.by_source, seconds),
    )


# -- the route -----------------------------------------------------------------------------------
@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    loader = app.state.loader
    recorder = StatsRecorder(lambda: loader.stats().to_dict())
    recorder.start()
    app.state.stats_history = recorder
    try:
        yield
    finally:
        recorder.stop()


router = APIRouter(prefix="/v1/stats", tags=["stats"], lifespan=_lifespan)


@router.get("/history", dependencies=[require_data], responses=DATA | INVALID | BUSY)
def stats_history(
    request: Request,
    minutes: Annotated[
        int, Query(ge=1, le=KEEP_STEPS, description="How far back; at most one hour")
    ] = KEEP_STEPS,
) -> StatsHistory:
    """The last hour of loads, a point a minute: bytes, operations, failures, throughput and
    mean latency, in total, per I/O path, per tier and per source. Kept in memory since the
    server started; the last point is the current, partial minute."""
    recorder: StatsRecorder | None = getattr(request.app.state, "stats_history", None)
    if recorder is None:
        raise HttpError(503, "unavailable", "the stats history starts with the server")
    out = recorder.history()
    cutoff = out.now.timestamp() - minutes * recorder.step_s
    out.points = [p for p in out.points if p.end.timestamp() > cutoff]
    return out
