"""Heat at a glance: ``GET /v1/heat``, the hottest files and a heat histogram per tier.

``/v1/files`` pages by id and cannot sort by heat, and heat decays with time, so ordering
needs every record's heat at one instant. This route computes it in one pass over the
catalog, as the planner does, and returns only the summary.
"""

from __future__ import annotations

import bisect
import heapq
import time
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from app.api.deps import EngineDep
from app.api.responses import BUSY, DATA, INVALID
from app.auth import require_data
from app.schemas import FileOut, iso
from tiering.catalog import FileState
from tiering.engine import Engine

__all__ = ["HEAT_EDGES", "HeatOut", "TierHeat", "heat_summary", "router"]

# Lower bounds of the histogram's buckets; the last one is open-ended. The default policy's
# thresholds (10 for ssd, 100 for nvme) fall on bucket edges.
HEAT_EDGES: tuple[float, ...] = (0.0, 0.1, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)

router = APIRouter(prefix="/v1", tags=["files"])


class TierHeat(BaseModel):
    files: int = Field(description="Files on the tier (missing ones left out)")
    counts: list[int] = Field(description="Files per heat bucket, one per edge")


class HeatOut(BaseModel):
    at: datetime = Field(description="The instant every heat is decayed to")
    half_life_s: float
    edges: list[float] = Field(
        description="Lower bound of each bucket: bucket i holds edges[i] <= heat < edges[i+1]"
    )
    tiers: dict[str, TierHeat] = Field(description="Every tier, fastest first")
    hottest: list[FileOut] = Field(description="The hottest files, hottest first")


def heat_summary(engine: Engine, top: int, now: float | None = None) -> HeatOut:
    """Histogram per tier and the ``top`` hottest files, every heat decayed to ``now``."""
    now = time.time() if now is None else now
    tiers = {t.name: TierHeat(files=0, counts=[0] * len(HEAT_EDGES)) for t in engine.tiers}
    scored = []
    for rec in engine.catalog.all():
        if rec.state == FileState.MISSING:
            continue
        h = engine.heat(rec, now)
        scored.append((h, rec))
        th = tiers.get(rec.tier)
        if th is None:  # a tier removed from the configuration
            th = tiers[rec.tier] = TierHeat(files=0, counts=[0] * len(HEAT_EDGES))
        th.files += 1
        th.counts[max(0, bisect.bisect_right(HEAT_EDGES, h) - 1)] += 1
    hottest = heapq.nlargest(top, scored, key=lambda hr: (hr[0], -hr[1].id))
    at = iso(now)
    assert at is not None
    return HeatOut(
        at=at,
        half_life_s=engine.policy().half_life_s,
        edges=list(HEAT_EDGES),
        tiers=tiers,
        hottest=[FileOut.of(rec, h) for h, rec in hottest],
    )


@router.get("/heat", dependencies=[require_data], responses=DATA | INVALID | BUSY)
def heat(
    engine: EngineDep,
    top: Annotated[int, Query(ge=0, le=500, description="How many of the hottest files")] = 20,
) -> HeatOut:
    """The hottest files and, per tier, how many files fall in each heat bucket. Reads every
    record once (like a planner pass), so poll it every few seconds, not in a loop."""
    return heat_summary(engine, top)
