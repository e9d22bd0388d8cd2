"""Pins: a pinned file stays on (or goes to) its tier whatever its heat."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from app.api.deps import EngineDep
from app.api.responses import ADMIN, BUSY, CONFLICT, INVALID, MAX_ID, NOT_FOUND
from app.auth import require_admin
from app.schemas import FileOut, PinRequest

router = APIRouter(prefix="/v1/files", tags=["files"])

FileId = Annotated[int, Path(ge=1, le=MAX_ID, description="Catalog id of the file")]


@router.post(
    "/{file_id}/pin",
    dependencies=[require_admin],
    responses=ADMIN | NOT_FOUND | CONFLICT | INVALID | BUSY,
)
def pin(engine: EngineDep, file_id: FileId, body: PinRequest | None = None) -> FileOut:
    """Pin the file to ``tier`` (default: the tier it is on). Policy then never moves it except
    to its pin, and the next scheduler pass brings it there. 409 while it is being migrated to
    another tier."""
    rec = engine.pin(file_id, (body or PinRequest()).tier)
    return FileOut.of(rec, engine.heat(rec))


@router.delete(
    "/{file_id}/pin",
    dependencies=[require_admin],
    responses=ADMIN | NOT_FOUND | CONFLICT | INVALID | BUSY,
)
def unpin(engine: EngineDep, file_id: FileId) -> FileOut:
    """Remove the pin; policy moves the file by heat again."""
    rec = engine.unpin(file_id)
    return FileOut.of(rec, engine.heat(rec))
