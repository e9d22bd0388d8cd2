"""The tiering policy: read, replace, and a dry run of what it would move now."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query

from app.api.deps import EngineDep
from app.api.responses import ADMIN, BUSY, DATA, JSON_BODY, MAX_ID
from app.auth import require_admin, require_data
from app.schemas import DecisionOut, PlanExplainOut, PlannedMoveOut, PlanOut, PolicyOut, iso
from tiering.placement import Policy, decide
from tiering.placement.explain import order_moves

router = APIRouter(prefix="/v1/policy", tags=["policy"])

PolicyBody = Annotated[
    Any,
    Body(
        description="A policy document: see GET /v1/policy for its shape and current values",
        # Any, not a model: Policy.parse names every problem of the document in one 422.
        json_schema_extra={"type": "object"},
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


@router.put("", dependencies=[require_admin], responses=ADMIN | JSON_BODY | BUSY)
def put_policy(engine: EngineDep, document: PolicyBody) -> PolicyOut:
    """Replace the policy (stored as the next version, applied at once). Fields left out take
    their defaults. An invalid document is refused with 422 and a message naming each problem;
    nothing is stored."""
    return PolicyOut.of(engine.set_policy(document, author="admin"))


@router.post("/plan", dependencies=[require_admin], responses=ADMIN | JSON_BODY | BUSY)
def plan(
    engine: EngineDep,
    document: Annotated[
        Any,
        Body(
            description="A draft policy to plan with; none: the policy in force",
            json_schema_extra={"anyOf": [{"type": "object"}, {"type": "null"}]},
        ),
    ] = None,
    explain: Annotated[
        Literal["all"] | None,
        Query(description="all: also list the files held back and why (paginated)"),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="Held files per page")] = 100,
    cursor: Annotated[
        int | None, Query(ge=0, le=MAX_ID, description="Held files with ids above this")
    ] = None,
) -> PlanExplainOut | PlanOut:
    """Dry run: the moves the policy in force (or the draft policy in the body) would make now,
    each with its reason. Nothing moves. With ``explain=all`` it also lists the files the plan
    leaves on a tier other than the one they want (or that the scheduler will not move),
    with each reason that holds them, ``limit`` at a time by file id after ``cursor``."""
    now = time.time()
    if document is None:
        info = engine.policy_info()
        policy = info.policy
        version: int | None = info.version
    else:
        memory = engine.memory.name if engine.memory is not None else None
        policy = Policy.parse(document, engine.config.tier_names(), memory=memory)
        version = None
    at = iso(now)
    assert at is not None
    if explain is None:
        moves = engine.plan(policy, now=now)
        return PlanOut(policy_version=version, at=at, moves=[PlannedMoveOut.of(m) for m in moves])
    decisions = decide(
        engine.catalog.all(),
        policy.without(engine.tiers.caches),  # the memory tier is a cache: not planned here
        engine.tier_states(),
        now,
        in_flight={m.file_id: m.id for m in engine.journal.open_intents() if m.file_id is not None},
        scheduler_on=engine.scheduler.running and policy.enabled,
    )
    moves = order_moves([d.move for d in decisions if d.move is not None], policy)
    held = sorted(
        (
            d
            for d in decisions
            if d.move is None
            and (d.reasons or d.wanted_tier != d.tier)
            and d.file_id > (cursor or 0)
        ),
        key=lambda d: d.file_id,
    )
    page = held[:limit]
    return PlanExplainOut(
        policy_version=version,
        at=at,
        moves=[PlannedMoveOut.of(m) for m in moves],
        held=[DecisionOut.of(d) for d in page],
        next_cursor=page[-1].file_id if len(held) > limit else None,
    )
