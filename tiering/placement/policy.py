"""The tiering policy and the planner.

The policy is a validated, versioned document: which heat sends a file to which tier, with a
hysteresis band so that a file sitting at a threshold does not ping-pong, per-tier quotas with
high and low watermarks, a minimum age before a move, and the scheduler's knobs (interval,
concurrency, bandwidth cap).

:func:`plan` is a pure function of (files, policy, tier usage, now): it reads nothing else and
changes nothing, so it can be tested exhaustively. Its guarantees:

- it never plans a move that takes a tier past its capacity (free space, and the high watermark
  of its quota), and a tier already past its capacity only shrinks;
- it plans at most one move per file;
- a pinned file only ever moves to its pin;
- applying the plan and planning again (at the same ``now``) yields nothing.

How a file's tier is chosen
---------------------------
Tiers are ordered fastest first, each with a ``min_heat``. A file wants the fastest tier whose
``min_heat`` its heat reaches. With hysteresis ``h``, a promotion needs ``heat ≥ min_heat·(1+h)``
and a demotion happens only once ``heat < min_heat·(1-h)``; in between the file stays.

Space: a tier past its high watermark gives up its coldest files until it is under its low
watermark. Promotions fill a tier only up to its low watermark, demotions and pins up to its high
watermark, and nothing ever goes past the free space of the tier's filesystem.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tiering.catalog.db import decay
from tiering.errors import InvalidPolicy

__all__ = [
    "FileView",
    "PlannedMove",
    "Policy",
    "TierPolicy",
    "TierState",
    "default_policy",
    "plan",
]

DAY = 86_400.0
MIB = 1 << 20


class TierPolicy(BaseModel):
    """The rules of one tier."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_heat: float = Field(ge=0, description="Heat a file needs to belong on this tier")
    quota_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Most bytes tierd places here; default the tier's configured quota (if any)",
    )
    high_watermark: float = Field(
        default=0.9, gt=0, le=1, description="Fraction of the quota that triggers demotions"
    )
    low_watermark: float = Field(
        default=0.8, ge=0, le=1, description="Fraction of the quota demotions bring it under"
    )

    @model_validator(mode="after")
    def _marks(self) -> TierPolicy:
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must not be above high_watermark "
                f"({self.high_watermark})"
            )
        return self


class Policy(BaseModel):
    """The policy document (stored as JSON, one row per version).

    Tiers not named in ``tiers`` get no say: use :meth:`for_tiers` to check a document against
    the engine's tiers, which also puts ``tiers`` in rank order.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tiers: dict[str, TierPolicy] = Field(description="Rules per tier, by tier name")
    half_life_s: float = Field(default=DAY, gt=0, description="Heat halves every this many s")
    hysteresis: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        description="Fraction around each threshold inside which a file stays where it is",
    )
    min_age_s: float = Field(
        default=600.0,
        ge=0,
        description="Seconds since a file was written or last moved before policy moves it",
    )
    interval_s: float = Field(default=60.0, ge=0.05, description="Seconds between scheduler passes")
    concurrency: int = Field(default=2, ge=1, le=64, description="Migrations run at once")
    bandwidth_bytes_per_s: int | None = Field(
        default=256 * MIB,
        gt=0,
        description="Cap on all migrations' copy rate together; null for no cap",
    )
    enabled: bool = Field(default=True, description="Whether the scheduler moves files by itself")

    @classmethod
    def parse(cls, document: object, tier_names: Sequence[str]) -> Policy:
        """Validate a JSON document against the engine's tiers.

        Raises
        ------
        InvalidPolicy
            With every problem spelled out with its location, e.g.
            ``tiers.ssd.min_heat: must be below nvme's min_heat (100)``.
        """
        if not isinstance(document, Mapping):
            raise InvalidPolicy("the policy must be a JSON object")
        try:
            policy = cls.model_validate(dict(document))
        except ValidationError as exc:
            raise InvalidPolicy(_explain(exc)) from None
        return policy.for_tiers(tier_names)

    def for_tiers(self, tier_names: Sequence[str]) -> Policy:
        """This policy with ``tiers`` in rank order, checked against ``tier_names``."""
        problems: list[str] = []
        unknown = [n for n in self.tiers if n not in tier_names]
        missing = [n for n in tier_names if n not in self.tiers]
        if unknown:
            problems.append(
                f"tiers: unknown tier {', '.join(map(repr, unknown))}; "
                f"the tiers are {', '.join(tier_names)}"
            )
        if missing:
            problems.append(f"tiers: missing rules for tier {', '.join(map(repr, missing))}")
        if not problems:
            ordered = [(n, self.tiers[n]) for n in tier_names]
            for (faster, fp), (slower, sp) in zip(ordered, ordered[1:], strict=False):
                if sp.min_heat >= fp.min_heat:
                    problems.append(
                        f"tiers.{slower}.min_heat: must be below {faster}'s min_heat "
                        f"({fp.min_heat:g}), because tiers are ordered fastest first; "
                        f"got {sp.min_heat:g}"
                    )
            last, lp = ordered[-1]
            if lp.min_heat != 0:
                problems.append(
                    f"tiers.{last}.min_heat: must be 0, so the slowest tier takes every file "
                    f"colder than the others; got {lp.min_heat:g}"
                )
        if problems:
            raise InvalidPolicy("; ".join(problems))
        return self.model_copy(update={"tiers": dict(ordered)})

    def document(self) -> dict[str, Any]:
        """The policy as a JSON-able document (what ``parse`` accepts)."""
        return self.model_dump(mode="json")


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "invalid"))
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        msg = msg.removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid policy"


def default_policy(tier_names: Sequence[str], *, half_life_s: float = DAY) -> Policy:
    """The policy in force until someone sets one.

    For the default tiers this is ≥ 100 → nvme, ≥ 10 → ssd, otherwise hdd. Other tier lists get
    thresholds by rank: the slowest 0, then 10, 100, 1000... towards the fastest.
    """
    n = len(tier_names)
    tiers = {
        name: TierPolicy(min_heat=0.0 if rank == n - 1 else float(10 ** (n - 1 - rank)))
        for rank, name in enumerate(tier_names)
    }
    return Policy(tiers=tiers, half_life_s=half_life_s)


# -- the planner ---------------------------------------------------------------------------------
class FileView(Protocol):
    """What the planner reads of a file (a catalog ``FileRecord`` is one)."""

    @property
    def id(self) -> int: ...
    @property
    def relpath(self) -> str: ...
    @property
    def tier(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def heat(self) -> float: ...
    @property
    def heat_at(self) -> float: ...
    @property
    def pinned_tier(self) -> str | None: ...
    @property
    def state(self) -> str: ...
    @property
    def updated_at(self) -> float: ...


@dataclass(frozen=True)
class TierState:
    """What the planner knows of a tier right now.

    ``used_bytes`` is what the catalog places on it (files being migrated away included);
    ``free_bytes`` the free space of its filesystem (None: unknown, treated as unlimited);
    ``quota_bytes`` the configured quota, which the policy may override.
    """

    name: str
    used_bytes: int
    free_bytes: int | None = None
    quota_bytes: int | None = None


@dataclass(frozen=True)
class PlannedMove:
    """One move the planner wants, with the reason a person can read."""

    file_id: int
    relpath: str
    src: str
    dst: str
    size: int
    heat: float
    kind: str  # "pin", "promote", "demote" or "watermark"
    reason: str


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


def plan(
    files: Iterable[FileView],
    policy: Policy,
    usage: Mapping[str, TierState],
    now: float,
) -> list[PlannedMove]:
    """The moves ``policy`` wants now, departures first, each with its reason.

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
    for rec in files:
        if rec.tier not in rank:
            continue
        heat = decay(rec.heat, rec.heat_at, now, policy.half_life_s)
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

    moves = [
        PlannedMove(
            f.id,
            f.relpath,
            names[f.home],
            names[f.place],
            f.size,
            round(f.heat, 3),
            f.kind,
            f.reason,
        )
        for f in fs
        if f.place != f.home
    ]
    # Departures first: demotions make room for the promotions that follow.
    moves.sort(
        key=lambda m: (
            rank[m.dst] < rank[m.src],
            -m.heat if rank[m.dst] < rank[m.src] else m.heat,
            m.file_id,
        )
    )
    return moves
