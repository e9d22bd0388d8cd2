"""Why each file is where it is: the planner's decision core.

:func:`decide` runs the planner to its fixpoint and returns, per file, one :class:`Decision`:
either the move it makes (the same move :func:`tiering.placement.policy.plan` lists, which is
built on it) or each reason that holds the file where it is, with its numbers: hysteresis, the
minimum age, a destination quota or watermark, free space, a pin, a move in flight, or the
scheduler being off (a manual move would still happen then).

The planner moves *units*: a file, or all the files of a model (a directory that holds
safetensors weights), which move together or not at all, by the heat of the model's hottest
weights (see :mod:`tiering.placement.units` for why). Every file of a model gets the model's
decision: the same wanted tier and heat, and, when the model does not fit where its heat
sends it, the same reason, with the room the whole model would need.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tiering.errors import FileNotFound
from tiering.placement.fleetheat import LocalHeat, heat_for_promotion
from tiering.placement.planner import Planner, fmt
from tiering.placement.policy import FileView, PlannedMove, Policy, TierState
from tiering.placement.units import Member, Unit, build_units

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
    model: str | None = None  # the model the file moves with (None: it moves alone)

    @property
    def action(self) -> str:
        return "move" if self.move is not None else "stay"


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
    origins: Collection[str] = (),
    local: LocalHeat | None = None,
) -> list[Decision]:
    """Per file (on a tier the policy knows), the move the planner makes or why it stays.

    ``in_flight`` maps file ids to the id of their open migration intent; ``scheduler_on`` is
    whether the scheduler will act by itself (policy ``enabled`` and a running scheduler).
    Arguments otherwise as for :func:`tiering.placement.policy.plan`. The files of a model get
    one decision between them (see the module docstring); ``Decision.heat`` is then the
    model's. ``origins``: tiers whose files never leave them (a fleet's shared tier, see
    :mod:`tiering.copies.hostcopies`); a unit with a file there stays, reason ``origin``.
    ``local``: this host's heat of files on shared tiers, which is their heat here when policy
    ``promotion_heat`` is ``local`` (see :func:`tiering.placement.fleetheat.heat_for_promotion`).
    """
    rank = {n: i for i, n in enumerate(policy.tiers)}
    recs = [rec for rec in files if rec.tier in rank]
    units = build_units(
        recs,
        rank,
        lambda rec: heat_for_promotion(policy, rec, now, local),
        min_age_s=policy.min_age_s,
        now=now,
    )
    fixed = {rank[t] for t in origins if t in rank}
    for u in units:
        if any(m.home in fixed for m in u.members):
            u.eligible = u.movable = False
    planner = Planner(policy, usage, units)
    planner.run()
    why_not = _Holding(planner, policy, now, in_flight or {}, fixed)
    out: dict[int, Decision] = {}
    for u in units:
        wanted, why = _wanted(planner, rank, u)
        moved = any(m.place != m.home for m in u.members)
        held = () if moved else tuple(why_not.reasons(u, wanted, ideal=planner.ideal(u.heat)))
        for m in u.members:
            out[m.id] = _decision(planner, u, m, wanted, why, held, policy, scheduler_on)
    return [out[rec.id] for rec in recs]


def decision_for(
    file_id: int,
    files: Iterable[FileView],
    policy: Policy,
    usage: Mapping[str, TierState],
    now: float,
    **kw: Any,
) -> Decision:
    """:func:`decide`'s decision for one file (the whole catalog is planned, as moves compete
    for room); ``kw`` as for :func:`decide`.

    Raises
    ------
    FileNotFound
        The file is on no tier the policy knows.
    """
    for d in decide(files, policy, usage, now, **kw):
        if d.file_id == file_id:
            return d
    raise FileNotFound(f"file {file_id} is on no tier the policy knows", file_id=file_id)


def _wanted(planner: Planner, rank: Mapping[str, int], u: Unit) -> tuple[int, str]:
    """The tier (its rank) a unit's heat or pin asks for, and why."""
    ideal, names, thresholds = planner.ideal(u.heat), planner.names, planner.thresholds
    if u.pinned is not None:
        wanted, why = rank[u.pinned], f"pinned to {u.pinned}"
    elif ideal == len(names) - 1 and len(names) > 1:
        wanted, why = ideal, f"heat {fmt(u.heat)} < {fmt(thresholds[ideal - 1])}"
    else:
        wanted, why = ideal, f"heat {fmt(u.heat)} ≥ {fmt(thresholds[ideal])}"
    return wanted, (why if u.model is None else f"model {u.model}: {why}")


def _decision(
    planner: Planner,
    u: Unit,
    m: Member,
    wanted: int,
    why: str,
    held: tuple[Reason, ...],
    policy: Policy,
    scheduler_on: bool,
) -> Decision:
    """One member's decision: its move in the plan, or the reasons its unit stays."""
    names = planner.names
    move_: PlannedMove | None = None
    reasons = list(held)
    if m.place != m.home:
        kind, reason = planner.member_move(u, m)
        move_ = PlannedMove(
            m.id, m.relpath, names[m.home], names[m.place], m.size, round(u.heat, 3), kind, reason
        )
    if not scheduler_on and (move_ is not None or wanted != m.home):
        reasons.append(
            Reason(
                "scheduler_disabled",
                "the scheduler is off (policy enabled=false or not running): it will "
                "not move this file by itself; a manual move still would",
                {"enabled": policy.enabled},
            )
        )
    return Decision(
        m.id,
        m.relpath,
        names[m.home],
        m.size,
        round(u.heat, 3),
        names[wanted],
        why,
        move_,
        tuple(reasons),
        u.model,
    )


class _Holding:
    """The reasons a unit that the plan leaves in place stays where it is."""

    def __init__(
        self,
        planner: Planner,
        policy: Policy,
        now: float,
        in_flight: Mapping[int, int],
        fixed: Collection[int] = (),
    ) -> None:
        self.p = planner
        self.fixed = fixed
        self.policy = policy
        self.now = now
        self.in_flight = in_flight

    def reasons(self, u: Unit, wanted: int, ideal: int) -> list[Reason]:
        p, names = self.p, self.p.names
        here = names[u.home]
        out: list[Reason] = []
        if u.pinned is not None and u.pinned == here and not u.split:
            if ideal != u.home:
                out.append(
                    Reason(
                        "pin",
                        f"pinned to {here}: policy would put it on {names[ideal]}",
                        {"pinned_tier": here},
                    )
                )
            return out
        if wanted == u.home and not u.split:
            return out
        origin = next((m for m in u.members if m.home in self.fixed), None)
        if origin is not None:
            there = names[origin.home]
            return [
                Reason(
                    "origin",
                    f"{there} is the fleet's shared origin: its files stay there; a hot one "
                    "gets a copy on a host's own tier instead",
                    {"tier": there},
                )
            ]
        unstable = next((m for m in u.members if m.rec.state != "stable"), None)
        if unstable is not None:
            return [self._state(u, unstable.rec)]
        if u.pinned is None:
            h = p.h
            age = self.now - max(m.rec.updated_at for m in u.members)
            if age < self.policy.min_age_s:
                out.append(
                    Reason(
                        "min_age",
                        f"age {age:.1f} s < min_age_s {self.policy.min_age_s:g}",
                        {"age_s": round(age, 3), "min_age_s": self.policy.min_age_s},
                    )
                )
            if wanted == u.home:  # where it belongs, but split: no room to gather it
                return out or self._room(u, u.home, "high")
            band = p.up_target(u.heat) if ideal < u.home else p.down_target(u.heat)
            if ideal < u.home and band >= u.home or ideal > u.home and band <= u.home:
                t = p.thresholds[ideal] if ideal < u.home else p.thresholds[u.home]
                sign = "+" if ideal < u.home else "-"
                lo, hi = t * (1 - h), t * (1 + h)
                out.append(
                    Reason(
                        "hysteresis",
                        f"heat {fmt(u.heat)} within ±{h:.0%} of {fmt(t)} "
                        f"({fmt(lo)}..{fmt(hi)}): needs {sign}{h:.0%} to move",
                        {"heat": round(u.heat, 3), "threshold": t, "low": lo, "high": hi},
                    )
                )
                return out
            if out:
                return out
            dst, mark = (band, "low") if band < u.home else (band, "high")
        else:
            dst, mark = wanted, "high"
        return out + self._room(u, dst, mark)

    def _state(self, u: Unit, rec: FileView) -> Reason:
        whose = "" if u.model is None else f"{rec.relpath} of {u.describe()}: "
        intent = self.in_flight.get(rec.id)
        if rec.state == "migrating" or intent is not None:
            return Reason(
                "in_flight",
                f"{whose}a move is in flight (intent {intent})",
                {"intent_id": intent} | ({} if u.model is None else {"model": u.model}),
            )
        return Reason(
            "state",
            f"{whose}the file is {rec.state}, not stable",
            {"state": rec.state} | ({} if u.model is None else {"model": u.model}),
        )

    def _room(self, u: Unit, dst: int, mark: str) -> list[Reason]:
        """Why ``u`` does not fit on ``dst`` under ``mark``: quota, free space, or both."""
        slot = self.p.slots[dst]
        size = u.cost(dst)
        frac = slot.low if mark == "low" else slot.high
        whole, extra = "", {}
        if u.model is not None:
            whole = f" ({u.describe()} moves whole or not at all)"
            extra = {"model": u.model, "files": len(u.members)}
        out: list[Reason] = []
        if slot.quota is not None and slot.used + size > slot.quota * frac:
            out.append(
                Reason(
                    "quota",
                    f"{slot.name} would exceed its {mark} watermark: {slot.used} + {size} "
                    f"bytes > {frac:.0%} of quota {slot.quota}{whole}",
                    {
                        "tier": slot.name,
                        "used_bytes": slot.used,
                        "size": size,
                        "quota_bytes": slot.quota,
                        "watermark": mark,
                        "limit_bytes": int(slot.quota * frac),
                    }
                    | extra,
                )
            )
        if slot.capacity is not None and slot.used + size > slot.capacity:
            free = slot.capacity - slot.used
            out.append(
                Reason(
                    "free_space",
                    f"{slot.name} lacks room: {free} bytes free < {size}{whole}",
                    {"tier": slot.name, "free_bytes": free, "size": size} | extra,
                )
            )
        return out


def plan(
    files: Iterable[FileView],
    policy: Policy,
    usage: Mapping[str, TierState],
    now: float,
    *,
    origins: Collection[str] = (),
    local: LocalHeat | None = None,
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
    origins:
        Tiers whose files never leave them (see :func:`decide`).
    local:
        This host's own heat of files on shared tiers, which lifts them off those tiers
        when policy ``promotion_heat`` is ``local`` (see :mod:`tiering.placement.fleetheat`).
    """
    return order_moves(
        [
            d.move
            for d in decide(files, policy, usage, now, origins=origins, local=local)
            if d.move is not None
        ],
        policy,
    )
