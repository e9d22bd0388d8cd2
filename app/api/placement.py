"""Why a file is where it is: ``GET /v1/files/{file_id}/placement``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from app.api.deps import EngineDep
from app.api.responses import BUSY, DATA, INVALID, MAX_ID, NOT_FOUND
from app.auth import require_data
from app.schemas import DecisionOut

router = APIRouter(prefix="/v1/files", tags=["files"])

FileId = Annotated[int, Path(ge=1, le=MAX_ID, description="Catalog id of the file")]


class PlacementOut(DecisionOut):
    """The planner's decision for one file under the policy in force, now."""


@router.get(
    "/{file_id}/placement",
    dependencies=[require_data],
    responses=DATA | NOT_FOUND | INVALID | BUSY,
)
def placement(engine: EngineDep, file_id: FileId) -> PlacementOut:
    """Why the file is on its tier: its heat now, the tier it wants and why, and either the
    move the policy makes for it or each reason that holds it (hysteresis, minimum age, a
    quota or watermark, free space, a pin, a move in flight, the scheduler being off)."""
    return PlacementOut.model_validate(DecisionOut.of(engine.explain(file_id)).model_dump())
