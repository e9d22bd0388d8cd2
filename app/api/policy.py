"""The tiering policy: read, replace, and a dry run of what it would move now."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Body

from app.api.deps import EngineDep
from app.api.responses import ADMIN, BUSY, DATA, INVALID
from app.auth import require_admin, require_data
from app.schemas import PlannedMoveOut, PlanOut, PolicyOut, iso
from tiering.placement import Policy

router = APIRouter(prefix="/v1/policy", tags=["policy"])

PolicyBody = Annotated[
    Any,
    Body(
        description="A policy document: see GET /v1/policy for its shape and current values",
        examples=[
            {
                "tiers": {
                    "nvme": {"min_heat": 100, "quota_bytes": None},
                    "ssd": {"min_heat": 10},
                    "hdd": {"min_heat": 0},
                },
                "half_life_s": 86400,
                "hysteresis": 0.2,
                "min_age_s": 600,
                "interval_s": 60,
                "concurrency": 2,
                "bandwidth_bytes_per_s": 268435456,
            }
        ],
    ),
]


@router.get("", dependencies=[require_data], responses=DATA | BUSY)
def get_policy(engine: EngineDep) -> PolicyOut:
    """The policy in force, with its version."""
    return PolicyOut.of(engine.policy_info())


@router.put("", dependencies=[require_admin], responses=ADMIN | INVALID | BUSY)
def put_policy(engine: EngineDep, document: PolicyBody) -> PolicyOut:
    """Replace the policy (stored as the next version, applied at once). Fields left out take
    their defaults. An invalid document is refused with 422 and a message naming each problem;
    nothing is stored."""
    return PolicyOut.of(engine.set_policy(document, author="admin"))


@router.post("/plan", dependencies=[require_admin], responses=ADMIN | INVALID | BUSY)
def plan(engine: EngineDep, document: Annotated[Any, Body()] = None) -> PlanOut:
    """Dry run: the moves the policy in force (or the draft policy in the body) would make now,
    each with its reason. Nothing moves."""
    now = time.time()
    if document is None:
        info = engine.policy_info()
        moves = engine.plan(info.policy, now=now)
        version: int | None = info.version
    else:
        moves = engine.plan(Policy.parse(document, engine.config.tier_names()), now=now)
        version = None
    at = iso(now)
    assert at is not None
    return PlanOut(policy_version=version, at=at, moves=[PlannedMoveOut.of(m) for m in moves])
