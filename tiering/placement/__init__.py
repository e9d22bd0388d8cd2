"""Placement: which tier each file belongs on. Access counting (heat), the policy and its planner
(a pure function: moves and their reasons), and the scheduler that submits planned moves; and the
memory tier's cache planner (also pure). Decisions only: the caches that carry them out live in
:mod:`tiering.copies`."""

from tiering.placement.access import AccessTracker
from tiering.placement.cache import CachedCopy, CacheDrop, CacheFill, CachePlan, plan_cache
from tiering.placement.current import CurrentPolicy, PolicyInfo
from tiering.placement.explain import Decision, Reason, decide, decision_for, plan
from tiering.placement.policy import (
    FileView,
    PlannedMove,
    Policy,
    TierPolicy,
    TierState,
    default_policy,
    memory_rule,
)
from tiering.placement.space import TierInfo, room, tier_infos, tier_states

__all__ = [
    "AccessTracker",
    "CacheDrop",
    "CacheFill",
    "CachePlan",
    "CachedCopy",
    "memory_rule",
    "plan_cache",
    "Decision",
    "Reason",
    "decide",
    "decision_for",
    "FileView",
    "PlannedMove",
    "Policy",
    "TierPolicy",
    "TierState",
    "default_policy",
    "plan",
    "CurrentPolicy",
    "PolicyInfo",
    "TierInfo",
    "room",
    "tier_infos",
    "tier_states",
]
