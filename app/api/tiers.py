"""Tiers."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import EngineDep
from app.auth import require_data
from app.schemas import TierOut

router = APIRouter(prefix="/v1", tags=["tiers"], dependencies=[require_data])


@router.get("/tiers")
def list_tiers(engine: EngineDep) -> list[TierOut]:
    """Tiers, fastest first, with capacity, use, quota and the catalog's files on each."""
    return [TierOut.of(t) for t in engine.tier_infos()]
