"""Why each file is where it is: the planner's decision core.

:func:`decide` runs the planner to its fixpoint and returns, per file, one :class:`Decision`:
either the move it makes (the same move :func:`tiering.placement.policy.plan` lists, which is
built on it) or each reason that holds the file where it is, with its numbers: hysteresis, the
minimum age, a destination quota or watermark, free space, a pin, a move in flight, or the
scheduler being off (a manual move would still happen then).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tiering.placement.policy import FileView, PlannedMove, Policy, TierState, heat_now

__all__ = ["Decision", "Reason", "decide", "order_moves", "plan"]


@dataclass(frozen=True)
class Reason:
    """One reason a file stays where it is (or that the scheduler will not act on its move).

    ``code`` is one of ``hysteresis``, ``min_age``, ``quota``, ``free_space``, ``pin``,
    ``in_flight``, ``state``, ``scheduler_disabled``; ``data`` holds its numbers.
    """

    code: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """What the planner decides for one file now."""

    file_id: int
    relpath: str
    tier: str
    size: int
    heat: float
    wanted_tier: str
    why: str
    move: PlannedMove | None
    reasons: tuple[Reason, ...] = ()

    @property
    def action(self) -> str:
        return "move" if self.move is not None else "stay"


@dataclass
class _Slot:
    name: str
    rank: int
    used: int
    capacity: int | None  # used + free at plan time: what the filesystem can hold
    quota: int | None
    high: float
    low: float
    start_used: int = 0

    def limit(self, mark: float) -> float:
        caps = [math.inf]
        if self.capacity is not None:
            caps.append(self.capacity)
        if self.quota is not None:
            caps.append(self.quota * mark)
        return min(caps)

    def fits(self, size: int, mark: float) -> bool:
        return self.used + size <= self.limit(mark)


@dataclass
class _F:
    id: int
    relpath: str
    size: int
    heat: float
    pinned: str | None
    home: int  # rank where the file is now
    place: int  # rank where the plan puts it
    eligible: bool  # stable and old enough for policy moves
    movable: bool  # stable (pins ignore the minimum age)
    kind: str = ""
    reason: str = ""
    rules: list[float] = field(default_factory=list)


def _fmt(x: float) -> str:
    return f"{x:.1f}" if x < 1e6 else f"{x:.3g}"


def order_moves(moves: list[PlannedMove], policy: Policy) -> list[PlannedMove]:
    """Departures first: demotions make room for the promotions that follow."""
    rank = {n: i for i, n in enumerate(policy.tiers)}
    return sorted(
        moves,
        key=lambda m: (
            rank[m.dst] < rank[m.src],
            -m.heat if rank[m.dst] < rank[m.src] else m.heat,
            m.file_id,
        ),
    )


def decide(
    files: Iterable[FileView],
    policy: Policy,
    usage: Mapping[str, TierState],
    now: float,
    *,
    in_flight: Mapping[int, int] | None = None,
    scheduler_on: bool = True,
) -> list[Decision]:
    """Per file (on a tier the policy knows), the move the planner makes or why it stays.

    ``in_flight`` maps file ids to the id of their open migration intent; ``scheduler_on`` is
    whether the scheduler will act by itself (policy ``enabled`` and a running scheduler).
    Arguments otherwise as for :func:`tiering.placement.policy.plan`.
    """
    in_flight = in_flight or {}
    names = list(policy.tiers)
    rank = {n: i for i, n in enumerate(names)}
    slots: list[_Slot] = []
    for name, tp in policy.tiers.items():
        st = usage.get(name, TierState(name, 0))
        quota = tp.quota_bytes if tp.quota_bytes is not None else st.quota_bytes
        capacity = None if st.free_bytes is None else st.used_bytes + max(0, st.free_bytes)
        slots.append(
            _Slot(
                name,
                rank[name],
                st.used_bytes,
                capacity,
                quota,
                tp.high_watermark,
                tp.low_watermark,
                st.used_bytes,
            )
        )
    thresholds = [tp.min_heat for tp in policy.tiers.values()]
    h = policy.hysteresis

    fs: list[_F] = []
    recs: list[FileView] = []
    for rec in files:
        if rec.tier not in rank:
            continue
        recs.append(rec)
        heat = heat_now(rec, policy, now)
        stable = rec.state == "stable"
        fs.append(
            _F(
                rec.id,
                rec.relpath,
                int(rec.size),
                heat,
                rec.pinned_tier if rec.pinned_tier in rank else None,
                rank[rec.tier],
                rank[rec.tier],
                stable and now - rec.updated_at >= policy.min_age_s,
                stable,
            )
        )

    def up_target(heat: float) -> int:
        return next(
            i for i, t in enumerate(thresholds) if heat >= t * (1 + h) or i == len(names) - 1
        )

    def down_target(heat: float) -> int:
        return next(
            i for i, t in enumerate(thresholds) if heat >= t * (1 - h) or i == len(names) - 1
        )

    def move(f: _F, to: int, kind: str, reason: str) -> None:
        slots[f.place].used -= f.size
        slots[to].used += f.size
        f.place = to
        f.kind, f.reason = kind, reason

    def heat_reason(f: _F, to: int) -> str:
        src, dst = names[f.home], names[to]
        if to < f.home:
            thr = thresholds[up_target(f.heat)]
            why = f"heat {_fmt(f.heat)} ≥ {_fmt(thr)}"
            if h:
                why += f" (+{h:.0%} hysteresis)"
            if to != up_target(f.heat):
                why += f", {names[up_target(f.heat)]} has no room"
            return f"{why}: promote {src} → {dst}"
        thr = thresholds[f.home]
        why = f"heat {_fmt(f.heat)} < {_fmt(thr)}"
        if h:
            why += f" (-{h:.0%} hysteresis)"
        return f"{why}: demote {src} → {dst}"

    def demote(f: _F) -> bool:
        want = down_target(f.heat)
        if want <= f.place:
            return False
        for to in range(want, len(slots)):
            if slots[to].fits(f.size, slots[to].high):
                move(f, to, "demote", heat_reason(f, to))
                return True
        return False

    def evict(slot: _Slot) -> bool:
        # Residents only: a file that arrived in this plan was admitted under the marks.
        assert slot.quota is not None
        over, moved = slot.used, False
        residents = sorted(
            (f for f in fs if f.place == slot.rank and f.home == slot.rank),
            key=lambda f: (f.heat, f.id),
        )
        for f in residents:
            if slot.used <= slot.quota * slot.low:
                break
            if not f.eligible or f.pinned is not None:
                continue
            for to in range(max(slot.rank + 1, down_target(f.heat)), len(slots)):
                if slots[to].fits(f.size, slots[to].high):
                    move(
                        f,
                        to,
                        "watermark",
                        f"{slot.name} holds {over} bytes, over its high watermark "
                        f"({slot.high:.0%} of {slot.quota}): demote one of its coldest files "
                        f"(heat {_fmt(f.heat)}) {slot.name} → {names[to]}",
                    )
                    moved = True
                    break
        return moved

    def promote(f: _F) -> bool:
        want = up_target(f.heat)
        for to in range(want, f.place):
            if slots[to].fits(f.size, slots[to].low):
                if to == f.home:
                    move(f, to, "", "")  # back where it is: the move is cancelled
                else:
                    move(f, to, "promote", heat_reason(f, to))
                return True
        return False

    # Everything runs to a fixpoint. Each step moves a file towards its heat band (or a pinned
    # file to its pin, or a tier's coldest files off it while it is past its high mark, which
    # only happens before the tier first drops under it), so the loop ends. At the end nothing
    # that wants to move fits anywhere it may go, which is what makes planning again after
    # applying the plan yield nothing.
    changed = True
    while changed:
        changed = False
        for f in sorted(fs, key=lambda f: (f.heat, f.id)):
            if f.eligible and f.pinned is None and demote(f):
                changed = True
        for slot in slots:
            if slot.quota is not None and slot.used > slot.quota * slot.high and evict(slot):
                changed = True
        for f in sorted(fs, key=lambda f: (f.pinned is None, -f.heat, f.id)):
            if f.pinned is not None:
                pin = rank[f.pinned]
                if f.movable and f.place != pin and slots[pin].fits(f.size, slots[pin].high):
                    kind = ("pin", f"pinned to {f.pinned}: move {names[f.home]} → {f.pinned}")
                    move(f, pin, *kind) if pin != f.home else move(f, pin, "", "")
                    changed = True
            elif f.eligible and up_target(f.heat) < f.place and promote(f):
                changed = True

    def holding(f: _F, rec: FileView, wanted: int, ideal: int) -> list[Reason]:
        """Each reason that keeps ``f`` (which the plan leaves in place) where it is."""
        here = names[f.home]
        out: list[Reason] = []
        if f.pinned is not None and f.pinned == here:
            if ideal != f.home:
                out.append(
                    Reason(
                        "pin",
                        f"pinned to {here}: policy would put it on {names[ideal]}",
                        {"pinned_tier": here},
                    )
                )
            return out
        if wanted == f.home:
            return out
        if rec.state != "stable":
            intent = in_flight.get(f.id)
            if rec.state == "migrating" or intent is not None:
                out.append(
                    Reason(
                        "in_flight",
                        f"a move is in flight (intent {intent})",
                        {"intent_id": intent},
                    )
                )
            else:
                out.append(
                    Reason("state", f"the file is {rec.state}, not stable", {"state": rec.state})
                )
            return out
        if f.pinned is None:
            age = now - rec.updated_at
            if age < policy.min_age_s:
                out.append(
                    Reason(
                        "min_age",
                        f"age {age:.1f} s < min_age_s {policy.min_age_s:g}",
                        {"age_s": round(age, 3), "min_age_s": policy.min_age_s},
                    )
                )
            band = up_target(f.heat) if ideal < f.home else down_target(f.heat)
            if ideal < f.home and band >= f.home or ideal > f.home and band <= f.home:
                t = thresholds[ideal] if ideal < f.home else thresholds[f.home]
                sign = "+" if ideal < f.home else "-"
                lo, hi = t * (1 - h), t * (1 + h)
                out.append(
                    Reason(
                        "hysteresis",
                        f"heat {_fmt(f.heat)} within ±{h:.0%} of {_fmt(t)} "
                        f"({_fmt(lo)}..{_fmt(hi)}): needs {sign}{h:.0%} to move",
                        {"heat": round(f.heat, 3), "threshold": t, "low": lo, "high": hi},
                    )
                )
                return out
            if out:
                return out
            dst, mark = (band, "low") if band < f.home else (band, "high")
        else:
            dst, mark = wanted, "high"
        slot = slots[dst]
        frac = slot.low if mark == "low" else slot.high
        if slot.quota is not None and slot.used + f.size > slot.quota * frac:
            out.append(
                Reason(
                    "quota",
                    f"{slot.name} would exceed its {mark} watermark: {slot.used} + {f.size} "
                    f"bytes > {frac:.0%} of quota {slot.quota}",
                    {
                        "tier": slot.name,
                        "used_bytes": slot.used,
                        "size": f.size,
                        "quota_bytes": slot.quota,
                        "watermark": mark,
                        "limit_bytes": int(slot.quota * frac),
                    },
                )
            )
        if slot.capacity is not None and slot.used + f.size > slot.capacity:
            free = slot.capacity - slot.used
            out.append(
                Reason(
                    "free_space",
                    f"{slot.name} lacks room: {free} bytes free < {f.size}",
                    {"tier": slot.name, "free_bytes": free, "size": f.size},
                )
            )
        return out

    out: list[Decision] = []
    for f, rec in zip(fs, recs, strict=True):
        ideal = next(i for i, t in enumerate(thresholds) if f.heat >= t)
        if f.pinned is not None:
            wanted, why = rank[f.pinned], f"pinned to {f.pinned}"
        elif ideal == len(names) - 1 and len(names) > 1:
            wanted, why = ideal, f"heat {_fmt(f.heat)} < {_fmt(thresholds[ideal - 1])}"
        else:
            wanted, why = ideal, f"heat {_fmt(f.heat)} ≥ {_fmt(thresholds[ideal])}"
        reasons: list[Reason] = []
        move_: PlannedMove | None = None
        if f.place != f.home:
            move_ = PlannedMove(
                f.id,
                f.relpath,
                names[f.home],
                names[f.place],
                f.size,
                round(f.heat, 3),
                f.kind,
                f.reason,
            )
        else:
            reasons = holding(f, rec, wanted, ideal)
        if not scheduler_on and (move_ is not None or wanted != f.home):
            reasons.append(
                Reason(
                    "scheduler_disabled",
                    "the scheduler is off (policy enabled=false or not running): it will not "
                    "move this file by itself; a manual move still would",
                    {"enabled": policy.enabled},
                )
            )
        out.append(
            Decision(
                f.id,
                f.relpath,
                names[f.home],
                f.size,
                round(f.heat, 3),
                names[wanted],
                why,
                move_,
                tuple(reasons),
            )
        )
    return out


def plan(
    files: Iterable[FileView],
    policy: Policy,
    usage: Mapping[str, TierState],
    now: float,
) -> list[PlannedMove]:
    """The moves ``policy`` wants now, departures first, each with its reason.

    Built on :func:`decide`, which decides per file either a move or
    the reasons it stays, so moves and their explanations cannot disagree.

    Parameters
    ----------
    files:
        Every file record. Only ``stable`` files move; the others (migrating, missing,
        conflict, quarantined) still count towards their tier's use.
    policy:
        A policy whose ``tiers`` are in rank order (see :meth:`Policy.for_tiers`).
    usage:
        Per tier name, its use, free space and configured quota.
    now:
        Seconds since the epoch; heat is decayed to it.
    """
    return order_moves(
        [d.move for d in decide(files, policy, usage, now) if d.move is not None], policy
    )
