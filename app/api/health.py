"""Liveness and readiness.

Readiness has three answers. ``ready``: everything works. ``degraded`` (still 200): a shared
dependency is down but this host still serves loads, so a load balancer must keep sending them:
the catalog's database (PostgreSQL) unreachable, where loads of files on this host's tiers and
the shared tier answer from the last records read and moves and fleet jobs pause; or an
object-store tier unreachable, where loads from the other tiers go on and moves to or from it
fail and are retried; or files found damaged (``checks.integrity``), quarantined while every
other file is served; or a fleet without ``fleet_token`` (``checks.fleet``), whose hosts each
read the shared bucket. ``not_ready`` (503): tierd cannot serve, because the catalog failed
otherwise (a SQLite file it cannot read), a directory tier's root, this host's own disk, is
unusable, or another tierd with this host id took the host's lock while PostgreSQL restarted
(``checks.host_lock``: this process writes nothing any more).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from app.api.deps import EngineDep
from app.schemas import iso
from tiering.catalog import FileState
from tiering.engine import Engine
from tiering.errors import CatalogUnreachable, FileNotFound
from tiering.integrity import Damage

router = APIRouter(tags=["health"])

CATALOG_DEGRADED = (
    "serving loads of local files from last known records; moves and fleet jobs paused"
)
PEERS_OFF = "serving as one host: every shared file is read from the bucket by every host"
DAMAGE_DEGRADED = (
    "serving every other file; the damaged ones are quarantined until uploaded again or deleted"
)
OBJECT_TIER_DEGRADED = (
    "serving loads from the other tiers; moves to or from this tier fail and are retried later"
)


class Degradation(BaseModel):
    """One part that does not answer, and what tierd still does without it."""

    component: str = Field(description="`catalog`, `tier:<name>`, `integrity` or `fleet`")
    reason: str = Field(description="Why it does not answer")
    since: datetime | None = Field(description="When this host first saw it fail, if known")
    still_works: str = Field(description="What this host still serves meanwhile")


class ReadyOut(BaseModel):
    status: Literal["ready", "degraded", "not_ready"] = Field(
        description="`degraded` is still ready to serve loads (200); `not_ready` is a 503"
    )
    started_at: datetime | None
    checks: dict[str, Any] = Field(
        description="catalog, tiers, watcher, last_scan, integrity (files found damaged), "
        "fleet (whether peers are on); host_lock once another took the lock"
    )
    degraded: list[Degradation] = Field(
        default_factory=list, description="What is down while the status is `degraded`"
    )


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    # On the event loop (no trip to the thread pool): a probe must not queue behind the work.
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=ReadyOut,
    responses={503: {"model": ReadyOut, "description": "Not ready: tierd cannot serve"}},
)
def readyz(engine: EngineDep) -> JSONResponse:
    """``ready`` when the catalog answers and every tier is usable; ``degraded`` (200) when
    the catalog's database or an object-store tier does not answer but loads still do (the
    ``degraded`` list says what is down and what still works); ``not_ready`` (503) otherwise."""
    checks: dict[str, object] = {}
    degraded: list[Degradation] = []
    ok = True
    try:
        checks["catalog"] = {"ok": True, "files": engine.catalog.count()}
    except CatalogUnreachable as exc:
        checks["catalog"] = {"ok": False, "error": exc.message}
        degraded.append(_catalog_down(engine, exc.message))
    except Exception as exc:
        ok = False
        checks["catalog"] = {"ok": False, "error": str(exc)}
    fenced = engine.catalog.db.fenced
    if fenced is not None:  # another tierd acts as this host now: this one must not serve
        ok = False
        checks["host_lock"] = {"ok": False, "error": fenced}
    tiers = {}
    for tier in engine.tiers:
        usable = tier.reachable()
        if not usable and not tier.capabilities.local_files:
            degraded.append(
                Degradation(
                    component=f"tier:{tier.name}",
                    reason=f"tier {tier.name} ({tier.location}) does not answer",
                    since=None,
                    still_works=OBJECT_TIER_DEGRADED,
                )
            )
        elif not usable:
            ok = False
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
    degraded += _unlisted(engine, {d.component for d in degraded})
    checks["fleet"], checks["integrity"] = _fleet(engine, degraded), _integrity(engine, degraded)
    status: Literal["ready", "degraded", "not_ready"] = (
        "not_ready" if not ok else "degraded" if degraded else "ready"
    )
    body = ReadyOut(
        status=status,
        started_at=iso(engine.started_at),
        checks=checks,
        degraded=degraded,
    )
    return JSONResponse(jsonable_encoder(body), status_code=200 if ok else 503)


def _unlisted(engine: Engine, down: set[str]) -> list[Degradation]:
    """The tiers the last scan could not list (and that answer now: those that do not are
    said already)."""
    scan = engine.last_scan
    if scan is None:
        return []
    return [
        Degradation(
            component=f"tier:{name}",
            reason=f"tier {name} could not be listed at its last scan: {why}",
            since=iso(scan.finished_at),
            still_works=OBJECT_TIER_DEGRADED,
        )
        for name, why in scan.failed.items()
        if f"tier:{name}" not in down
    ]


def _fleet(engine: Engine, degraded: list[Degradation]) -> dict[str, object]:
    """Whether this host uses its peers: a shared catalog and bucket without ``fleet_token``
    is degraded (every host reads the bucket itself)."""
    if engine.peers_off is not None:
        degraded.append(
            Degradation(
                component="fleet",
                reason=engine.peers_off,
                since=iso(engine.started_at),
                still_works=PEERS_OFF,
            )
        )
    return {"peers": engine.peers_off is None, "reason": engine.peers_off}


def _integrity(engine: Engine, degraded: list[Degradation]) -> dict[str, object]:
    """The files found damaged and still quarantined (degraded while there are any)."""
    damaged = _still_damaged(engine)
    if damaged:
        first = damaged[0]
        degraded.append(
            Degradation(
                component="integrity",
                reason=f"{len(damaged)} file(s) found damaged and quarantined, such as "
                f"{first.relpath!r} on tier {first.tier}: {first.reason}",
                since=iso(min(d.found_at for d in damaged)),
                still_works=DAMAGE_DEGRADED,
            )
        )
    return {
        "ok": not damaged,
        "failures": engine.damage.failures,
        "damaged": [
            {"tier": d.tier, "path": d.relpath, "reason": d.reason, "file_id": d.file_id}
            for d in damaged[:20]
        ],
    }


def _still_damaged(engine: Engine) -> list[Damage]:
    """The damage this process found that still stands: a record uploaded again, deleted or
    released from quarantine since is dropped (a file without a record stays until a scan
    finds it gone or sound)."""
    out = []
    for d in engine.damage.items():
        if d.file_id is not None:
            try:
                rec = engine.catalog.get(d.file_id)
            except FileNotFound:
                rec = None
            except CatalogUnreachable:
                out.append(d)  # cannot tell now
                continue
            if rec is None or rec.state != FileState.QUARANTINED or rec.relpath != d.relpath:
                engine.damage.clear(d.tier, d.relpath)
                continue
        out.append(d)
    return out


def _catalog_down(engine: Engine, message: str) -> Degradation:
    outage = engine.catalog.db.outage
    return Degradation(
        component="catalog",
        reason=message,
        since=iso(outage.since) if outage is not None else None,
        still_works=CATALOG_DEGRADED,
    )
