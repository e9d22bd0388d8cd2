"""Pins: a pinned file stays on (or goes to) its tier whatever its heat."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import BY_ID, EngineDep, FileId
from app.api.responses import ADMIN, BUSY, CONFLICT, INVALID, JSON_BODY, NOT_FOUND
from app.auth import require_admin
from app.schemas import FileOut, PinRequest

router = APIRouter(prefix="/v1/files", tags=["files"])


@router.post(
    BY_ID + "/pin",
    dependencies=[require_admin],
    responses=ADMIN | NOT_FOUND | CONFLICT | JSON_BODY | BUSY,
)
def pin(engine: EngineDep, file_id: FileId, body: PinRequest | None = None) -> FileOut:
    """Pin the file to ``tier`` (default: the tier it is on). Policy then never moves it except
    to its pin, and the next scheduler pass brings it there. 409 while it is being migrated to
    another tier."""
    rec = engine.pin(file_id, (body or PinRequest()).tier)
    return FileOut.of(rec, engine.heat(rec))


@router.delete(
    BY_ID + "/pin",
    dependencies=[require_admin],
    responses=ADMIN | NOT_FOUND | CONFLICT | INVALID | BUSY,
)
def unpin(engine: EngineDep, file_id: FileId) -> FileOut:
    """Remove the pin; policy moves the file by heat again."""
    rec = engine.unpin(file_id)
    return FileOut.of(rec, engine.heat(rec))
