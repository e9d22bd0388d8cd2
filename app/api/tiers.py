"""Tiers, and reconciling them with the catalog on demand."""

from __future__ import annotations

import functools
from typing import Annotated, Any

from fastapi import APIRouter, Query

from app.api.deps import EngineDep
from app.api.responses import ADMIN, BUSY, DATA, INVALID
from app.auth import require_admin, require_data
from app.schemas import TierOut

router = APIRouter(prefix="/v1", tags=["tiers"])


@functools.cache
def gds_host() -> bool:
    """Whether this host has GPUDirect Storage proper (asked once: it loads KvikIO)."""
    from tiering.io import GpuDirectStorage

    return GpuDirectStorage.is_available()


@router.get("/tiers", dependencies=[require_data], responses=DATA | BUSY)
def list_tiers(engine: EngineDep) -> list[TierOut]:
    """Tiers, fastest first, with capacity, use, quota, the catalog's files on each, and whether
    loads from it take the GPUDirect Storage path."""
    gds = gds_host()
    return [TierOut.of(t, gds_host=gds) for t in engine.tier_infos()]


@router.post("/scan", dependencies=[require_admin], responses=ADMIN | INVALID | BUSY)
def scan(
    engine: EngineDep,
    check: Annotated[bool, Query(description="Only report the drift; change nothing")] = False,
) -> dict[str, Any]:
    """Walk every tier root now and bring the catalog in line with it (what ``tierd scan``
    does while no server runs): adopted, changed, moved, renamed, missing and conflicts."""
    return engine.scan(check=check).as_dict()
