"""Why a file is where it is: ``GET /v1/files/{file_id}/placement``."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import BY_ID, EngineDep, FileId
from app.api.responses import BUSY, DATA, INVALID, NOT_FOUND
from app.auth import require_data
from app.schemas import DecisionOut

router = APIRouter(prefix="/v1/files", tags=["files"])


class PlacementOut(DecisionOut):
    """The planner's decision for one file under the policy in force, now."""


@router.get(
    BY_ID + "/placement",
    dependencies=[require_data],
    responses=DATA | NOT_FOUND | INVALID | BUSY,
)
def placement(engine: EngineDep, file_id: FileId) -> PlacementOut:
    """Why the file is on its tier: its heat now, the tier it wants and why, and either the
    move the policy makes for it or each reason that holds it (hysteresis, minimum age, a
    quota or watermark, free space, a pin, a move in flight, the scheduler being off)."""
    return PlacementOut.model_validate(DecisionOut.of(engine.explain(file_id)).model_dump())
