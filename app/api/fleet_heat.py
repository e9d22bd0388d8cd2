"""``GET /v1/fleet/heat``: a file's or a model's heat across the fleet, in sum and per host.

The fleet's heat is the file's heat in the catalog (every host's accesses add to it); each
host's own is its ``host_heat`` row (see :mod:`tiering.catalog.heat`). ``deciding_heat`` is the
one this host's planners compare to lift the file off a shared tier, per the policy's
``promotion_heat`` (see :mod:`tiering.placement.fleetheat`). The route only reads the catalog:
the records asked for and their host rows (one query per 500 files). Nothing counts as an
access.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

from app.api.deps import EngineDep, LoaderDep
from app.api.fleet import ModelParam, PathParam, asked_records
from app.api.responses import BUSY, DATA, INVALID, NOT_FOUND
from app.auth import require_data
from app.schemas import iso
from tiering.catalog.heat import HostHeatRow, HostHeats
from tiering.placement.fleetheat import LocalHeat, has_local_heat, heat_for_promotion

__all__ = ["FileHeatOut", "FleetHeatOut", "HostHeatOut", "router"]

router = APIRouter(prefix="/v1/fleet", tags=["fleet"])


class HostHeatOut(BaseModel):
    heat: float = Field(description="The host's own heat of the file now")
    access_count: int = Field(description="The host's accesses of the file")
    last_access: datetime | None


class FileHeatOut(BaseModel):
    id: int
    path: str
    tier: str
    host: str | None = Field(description="The host whose own tier holds it; null: a shared tier")
    fleet_heat: float = Field(description="The fleet's heat now: every host's accesses")
    access_count: int = Field(description="The fleet's accesses")
    last_access: datetime | None
    hosts: dict[str, HostHeatOut] = Field(
        description=(
            "Per host id, hottest first, that host's own heat. A file on a shared tier: each "
            "host that read it while it was there; a file on a host's own tier: that host, "
            "the only one that reads it (its heat is the fleet's)"
        )
    )
    local_heat: float = Field(description="This host's own heat of the file now")
    deciding_heat: float = Field(
        description=(
            "The heat this host's planners compare to lift the file off a shared tier onto "
            "its own tiers (per promotion_heat); for a file on a host's own tier, its heat"
        )
    )


class FleetHeatOut(BaseModel):
    at: datetime = Field(description="The instant every heat is decayed to")
    half_life_s: float
    promotion_heat: Literal["local", "fleet"] = Field(
        description="The policy's choice of heat for promotions off a shared tier"
    )
    this_host: str
    path: str | None = None
    model: str | None = None
    files: list[FileHeatOut]


def _host_out(row: HostHeatRow) -> HostHeatOut:
    return HostHeatOut(
        heat=round(row.heat, 6), access_count=row.access_count, last_access=iso(row.last_access)
    )


@router.get("/heat", dependencies=[require_data], responses=DATA | NOT_FOUND | INVALID | BUSY)
def fleet_heat(
    engine: EngineDep,
    loader: LoaderDep,
    path: PathParam = None,
    model: ModelParam = None,
) -> FleetHeatOut:
    """The heat of the file at ``path``, or of each file of ``model``, across the fleet: the
    fleet's (the sum of every host's) and each host's own, decayed to now, with the heat
    that decides a promotion off a shared tier on this host and the policy's
    ``promotion_heat``.

    422 for neither or both of ``path`` and ``model``, or a bad relpath; 404 for a file or a
    model the catalog does not have."""
    records = asked_records(engine, loader, path, model)
    now = time.time()
    policy = engine.policy()
    db = engine.catalog.db
    me = engine.config.host_id
    rows = HostHeats(db).of([r.id for r in records], now=now, half_life_s=policy.half_life_s)
    # The planners' view of this host's heat, from the rows just read (already decayed to now).
    mine = {fid: (hosts[me].heat, now) for fid, hosts in rows.items() if me in hosts}
    local = LocalHeat(db.shared_tiers, mine) if has_local_heat(db) else None
    files = []
    for rec in records:
        fleet = engine.heat(rec, now)
        if rec.host is not None:
            hosts = {rec.host: HostHeatRow(rec.host, fleet, rec.access_count, rec.last_access)}
        else:
            hosts = rows.get(rec.id, {})
        files.append(
            FileHeatOut(
                id=rec.id,
                path=rec.relpath,
                tier=rec.tier,
                host=rec.host,
                fleet_heat=round(fleet, 6),
                access_count=rec.access_count,
                last_access=iso(rec.last_access),
                hosts={h: _host_out(row) for h, row in hosts.items()},
                local_heat=round(hosts[me].heat, 6) if me in hosts else 0.0,
                deciding_heat=round(heat_for_promotion(policy, rec, now, local), 6),
            )
        )
    at = iso(now)
    assert at is not None
    return FleetHeatOut(
        at=at,
        half_life_s=policy.half_life_s,
        promotion_heat=policy.promotion_heat,
        this_host=me,
        path=path,
        model=model,
        files=files,
    )
