"""Migrations: start the plan or one manual move; list history and moves in flight."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from app.api.deps import EngineDep
from app.api.responses import (
    ADMIN,
    BUSY,
    CONFLICT,
    DATA,
    INVALID,
    JSON_BODY,
    MAX_ID,
    NO_SPACE,
    NOT_FOUND,
)
from app.auth import require_admin, require_data
from app.errors import HttpError
from app.schemas import MigrationList, MigrationOut, MigrationsStarted, MoveRequest
from tiering.catalog import MigrationPhase
from tiering.errors import TierdError
from tiering.moves import Claim

router = APIRouter(prefix="/v1/migrations", tags=["migrations"])

PHASES = (*MigrationPhase.OPEN, MigrationPhase.DONE, MigrationPhase.ABORTED, MigrationPhase.FAILED)


def _cursor(last_id: int) -> str:
    return base64.urlsafe_b64encode(f"mig:{last_id}".encode()).decode().rstrip("=")


def _uncursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        kind, _, value = raw.partition(":")
        if kind != "mig" or not value.isdigit():
            raise ValueError(raw)
        return int(value)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise HttpError(422, "invalid_cursor", "cursor is not one this server issued") from None


@router.post(
    "",
    dependencies=[require_admin],
    status_code=202,
    response_model=MigrationsStarted,
    responses={200: {"model": MigrationsStarted, "description": "wait=true: the moves finished"}}
    | ADMIN
    | NOT_FOUND
    | CONFLICT
    | JSON_BODY
    | BUSY
    | NO_SPACE,
)
def start_migrations(
    engine: EngineDep,
    body: MoveRequest | None = None,
    wait: Annotated[bool, Query(description="Reply when the moves have finished")] = False,
) -> JSONResponse:
    """With ``{file_id, to_tier}``: move that file (409 if it is migrating or pinned elsewhere,
    404 for an unknown file or tier). With no body: run the policy's plan now.

    The moves are claimed before the reply, so conflicts show at once; they run on the
    scheduler's workers (202), or, with ``wait=true``, finish before the reply (200; a manual
    move that fails answers with its error)."""
    body = body or MoveRequest()
    if body.file_id is not None or body.to_tier is not None:
        if body.file_id is None or body.to_tier is None:
            raise HttpError(422, "invalid_request", "a manual move needs both file_id and to_tier")
        claims: list[Claim] = [engine.submit_move(body.file_id, body.to_tier)]
        planned, skipped = 1, []
    else:
        report = engine.run_plan()
        claims, planned = report.claimed, report.planned
        skipped = [
            {"file_id": m.file_id, "path": m.relpath, "to_tier": m.dst, "why": why}
            for m, why in report.skipped
        ]
    if wait:
        for c in claims:
            c.done.wait()
        if body.file_id is not None and isinstance(claims[0].error, TierdError):
            raise claims[0].error
    items = [MigrationOut.of(engine.claimed(c)) for c in claims]
    out = MigrationsStarted(planned=planned, migrations=items, skipped=skipped)
    return JSONResponse(out.model_dump(mode="json"), status_code=200 if wait else 202)


@router.get("", dependencies=[require_data], responses=DATA | INVALID | BUSY)
def list_migrations(
    engine: EngineDep,
    state: Annotated[
        str | None,
        Query(description="in_flight, or one of copying, switched, done, aborted, failed"),
    ] = None,
    file_id: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> MigrationList:
    """History and in-flight moves, newest first, with state, bytes, duration and error."""
    phases: list[str] | None = None
    if state == "in_flight":
        phases = list(MigrationPhase.OPEN)
    elif state is not None:
        if state not in PHASES:
            raise HttpError(
                422, "invalid_state", f"state must be in_flight or one of {', '.join(PHASES)}"
            )
        phases = [state]
    before = _uncursor(cursor) if cursor else None
    rows = engine.migrations(phases=phases, file_id=file_id, before_id=before, limit=limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    return MigrationList(
        items=[MigrationOut.of(r) for r in rows],
        next_cursor=_cursor(rows[-1].record.id) if more else None,
    )
