"""The cache planner: which files the memory tier should hold copies of now.

:func:`plan_cache` is a pure function of (files, policy, the copies held, now), like the
storage planner, and follows the same rules as a tier's, read for a cache:

- a copy of a file that changed (another generation), went missing or is gone is dropped;
- a copy whose file cooled below ``min_heat·(1-h)`` is dropped;
- past the high watermark of the quota, the coldest copies are dropped until it is under the
  low watermark (those that still fit under it, hottest first, are kept);
- a stable file with heat ``≥ min_heat·(1+h)`` that has no copy gets one, hottest first, while
  the copies fit under the low watermark.

A copy a load holds, or that a prefetch keeps (``keep_until``), is never dropped for heat or
room (a change of the file still drops it; the memory tier frees it when the load lets go).
Applying the plan and planning again (at the same ``now``) yields nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from tiering.placement.planner import fmt
from tiering.placement.policy import FileView, Policy, TierPolicy, heat_now

__all__ = ["CacheDrop", "CacheFileView", "CacheFill", "CachePlan", "CachedCopy", "plan_cache"]

_STABLE = "stable"
_CURRENT = ("stable", "migrating")  # a move in flight has not changed the bytes yet


class CacheFileView(FileView, Protocol):
    """What the cache planner reads of a file: the storage planner's view and its generation."""

    @property
    def generation(self) -> int: ...


@dataclass(frozen=True)
class CachedCopy:
    """A copy the memory tier holds."""

    file_id: int
    generation: int
    size: int
    held: bool = False  # a load holds it now
    keep_until: float = 0.0


@dataclass(frozen=True)
class CacheFill:
    file_id: int
    relpath: str
    generation: int
    size: int
    heat: float
    reason: str


@dataclass(frozen=True)
class CacheDrop:
    file_id: int
    size: int
    heat: float | None  # None: the file is gone
    code: str  # "stale", "cold" or "watermark"
    reason: str


@dataclass(frozen=True)
class CachePlan:
    fills: list[CacheFill] = field(default_factory=list)
    drops: list[CacheDrop] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.fills or self.drops)


def plan_cache(
    files: Iterable[CacheFileView],
    policy: Policy,
    tier: str,
    copies: Iterable[CachedCopy],
    now: float,
    *,
    quota: int | None = None,
    heat_of: Callable[[CacheFileView], float] | None = None,
) -> CachePlan:
    """The fills and drops that bring memory tier ``tier`` in line with ``policy`` now.

    Parameters
    ----------
    files:
        Every file record.
    policy:
        A policy with rules for ``tier`` (its ``quota_bytes``, else ``quota``, bounds it).
    copies:
        The copies held now.
    heat_of:
        A file's heat now (default: its catalog heat decayed under ``policy``).
    """
    rule = policy.tiers[tier]
    recs = {f.id: f for f in files}
    of = heat_of if heat_of is not None else (lambda f: heat_now(f, policy, now))
    b = _Bounds(
        tier,
        rule,
        rule.quota_bytes if rule.quota_bytes is not None else quota,
        policy.hysteresis,
        {i: of(f) for i, f in recs.items()},
        now,
    )
    plan = CachePlan()
    kept = _keep_current_and_warm(b, recs, copies, plan)
    cached = {c.file_id for c in kept} | {d.file_id for d in plan.drops if d.code != "stale"}
    used = _within_watermarks(b, kept, plan)
    wanted = sorted(
        (
            f
            for f in recs.values()
            if f.id not in cached and f.state == _STABLE and b.heat[f.id] >= b.up
        ),
        key=lambda f: (-b.heat[f.id], f.id),
    )
    for f in wanted:
        if b.low is not None and used + f.size > b.low:
            continue
        used += f.size
        why = f"heat {fmt(b.heat[f.id])} ≥ {fmt(rule.min_heat)}"
        if b.h:
            why += f" (+{b.h:.0%} hysteresis)"
        plan.fills.append(
            CacheFill(
                f.id, f.relpath, f.generation, f.size, b.heat[f.id], f"{why}: copy into {tier}"
            )
        )
    return plan


@dataclass(frozen=True)
class _Bounds:
    """One cache tier's rule as a pass applies it: its cap, hysteresis and watermarks, and
    every file's heat now."""

    tier: str
    rule: TierPolicy
    cap: int | None
    h: float
    heat: dict[int, float]
    now: float

    @property
    def up(self) -> float:
        return self.rule.min_heat * (1 + self.h)

    @property
    def down(self) -> float:
        return self.rule.min_heat * (1 - self.h)

    @property
    def high(self) -> float | None:
        return None if self.cap is None else self.cap * self.rule.high_watermark

    @property
    def low(self) -> float | None:
        return None if self.cap is None else self.cap * self.rule.low_watermark

    def protected(self, c: CachedCopy) -> bool:
        return c.held or c.keep_until > self.now


def _keep_current_and_warm(
    b: _Bounds,
    recs: dict[int, CacheFileView],
    copies: Iterable[CachedCopy],
    plan: CachePlan,
) -> list[CachedCopy]:
    """The copies kept; stale ones (the file gone or changed) and cold ones unprotected by a
    lease or a prefetch's keep are planned as drops."""
    kept: list[CachedCopy] = []
    heat = b.heat
    for c in copies:
        f = recs.get(c.file_id)
        if f is None or f.generation != c.generation or f.state not in _CURRENT:
            why = "is gone" if f is None else "changed" if f.state in _CURRENT else f"is {f.state}"
            plan.drops.append(
                CacheDrop(c.file_id, c.size, heat.get(c.file_id), "stale", f"the file {why}")
            )
            continue
        if not b.protected(c) and heat[c.file_id] < b.down:
            why = f"heat {fmt(heat[c.file_id])} < {fmt(b.rule.min_heat)}"
            if b.h:
                why += f" (-{b.h:.0%} hysteresis)"
            plan.drops.append(CacheDrop(c.file_id, c.size, heat[c.file_id], "cold", f"{why}: drop"))
            continue
        kept.append(c)
    return kept


def _within_watermarks(b: _Bounds, kept: list[CachedCopy], plan: CachePlan) -> float:
    """Past the high watermark, the coldest unprotected copies planned as drops until the rest
    fit under the low one; the bytes the kept copies then use."""
    used: float = sum(c.size for c in kept)
    if b.high is None or b.low is None or used <= b.high:
        return used
    # Protected copies stay; the others are taken back hottest first while they fit.
    over, heat = used, b.heat
    used = sum(c.size for c in kept if b.protected(c))
    free = sorted(
        (c for c in kept if not b.protected(c)), key=lambda c: (-heat[c.file_id], c.file_id)
    )
    for c in free:
        if used + c.size <= b.low:
            used += c.size
            continue
        plan.drops.append(
            CacheDrop(
                c.file_id,
                c.size,
                heat[c.file_id],
                "watermark",
                f"{b.tier} holds {over} bytes, over its high watermark "
                f"({b.rule.high_watermark:.0%} of {b.cap}): drop one of its coldest copies "
                f"(heat {fmt(heat[c.file_id])})",
            ),
        )
    return used
