"""Tiers, and reconciling them with the catalog on demand."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from app.api.deps import EngineDep
from app.auth import require_admin, require_data
from app.schemas import TierOut

router = APIRouter(prefix="/v1", tags=["tiers"])


@router.get("/tiers", dependencies=[require_data])
def list_tiers(engine: EngineDep) -> list[TierOut]:
    """Tiers, fastest first, with capacity, use, quota and the catalog's files on each."""
    return [TierOut.of(t) for t in engine.tier_infos()]


@router.post("/scan", dependencies=[require_admin])
def scan(
    engine: EngineDep,
    check: Annotated[bool, Query(description="Only report the drift; change nothing")] = False,
) -> dict[str, Any]:
    """Walk every tier root now and bring the catalog in line with it (what ``tierd scan``
    does while no server runs): adopted, changed, moved, renamed, missing and conflicts."""
    return engine.scan(check=check).as_dict()
