"""Liveness and readiness."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from app.api.deps import EngineDep
from app.schemas import iso

router = APIRouter(tags=["health"])


class ReadyOut(BaseModel):
    status: Literal["ready", "not_ready"]
    started_at: datetime | None
    checks: dict[str, Any] = Field(description="catalog, tiers, watcher and last_scan")


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=ReadyOut,
    responses={503: {"model": ReadyOut, "description": "Not ready: a check failed"}},
)
def readyz(engine: EngineDep) -> JSONResponse:
    """Ready when the catalog answers and every tier root is a usable directory."""
    checks: dict[str, object] = {}
    ok = True
    try:
        checks["catalog"] = {"ok": True, "files": engine.catalog.count()}
    except Exception as exc:
        ok = False
        checks["catalog"] = {"ok": False, "error": str(exc)}
    tiers = {}
    for tier in engine.tiers:
        usable = tier.reachable()
        ok = ok and usable
        tiers[tier.name] = {"ok": usable, "kind": tier.kind, "location": tier.location}
    checks["tiers"] = tiers
    # The watcher's health is reported, not required: without it the catalog can drift from
    # the disk, but what it serves is still read from the disk, so tierd can still serve.
    watcher = engine.watcher
    checks["watcher"] = (
        watcher.status().as_dict()
        if watcher is not None
        else {"healthy": False, "backend": None, "reason": "disabled"}
    )
    scan = engine.last_scan
    checks["last_scan"] = scan.summary() if scan else None
    body = {
        "status": "ready" if ok else "not_ready",
        "started_at": iso(engine.started_at),
        "checks": checks,
    }
    return JSONResponse(jsonable_encoder(body), status_code=200 if ok else 503)
