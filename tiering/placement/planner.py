"""The planner's fixpoint: every unit (a file, or a model's files) moved, whole, towards the
tier its heat or pin asks for, as far as the tiers' room allows.

:class:`Planner` holds the tiers' room as the plan fills and empties them, and the units'
places. :func:`tiering.placement.explain.decide` runs it, then reads off each file's move or
the reasons it stays. A unit moves all-or-nothing: a move of a model is checked against the
room its files not yet on the destination need there, and if they do not all fit, none of
them moves (``decide`` then says which quota or free space held the model back).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tiering.placement.policy import Policy, TierState
from tiering.placement.units import Member, Unit

__all__ = ["Planner", "Slot", "fmt"]


def fmt(x: float) -> str:
    return f"{x:.1f}" if x < 1e6 else f"{x:.3g}"


@dataclass
class Slot:
    """A tier as the plan fills it."""

    name: str
    rank: int
    used: int
    capacity: int | None  # used + free at plan time: what the filesystem can hold
    quota: int | None
    high: float
    low: float

    def limit(self, mark: float) -> float:
        caps = [math.inf]
        if self.capacity is not None:
            caps.append(self.capacity)
        if self.quota is not None:
            caps.append(self.quota * mark)
        return min(caps)

    def fits(self, size: int, mark: float) -> bool:
        return self.used + size <= self.limit(mark)


class Planner:
    """Moves ``units`` over the tiers of ``policy`` (in rank order) to a fixpoint: see
    :meth:`run`."""

    def __init__(self, policy: Policy, usage: Mapping[str, TierState], units: list[Unit]) -> None:
        self.names = list(policy.tiers)
        self.rank = {n: i for i, n in enumerate(self.names)}
        self.thresholds = [tp.min_heat for tp in policy.tiers.values()]
        self.h = policy.hysteresis
        self.units = units
        self.slots: list[Slot] = []
        for name, tp in policy.tiers.items():
            st = usage.get(name, TierState(name, 0))
            quota = tp.quota_bytes if tp.quota_bytes is not None else st.quota_bytes
            capacity = None if st.free_bytes is None else st.used_bytes + max(0, st.free_bytes)
            self.slots.append(
                Slot(
                    name,
                    self.rank[name],
                    st.used_bytes,
                    capacity,
                    quota,
                    tp.high_watermark,
                    tp.low_watermark,
                )
            )

    # -- heat bands --------------------------------------------------------------------------
    def up_target(self, heat: float) -> int:
        last = len(self.names) - 1
        return next(
            i for i, t in enumerate(self.thresholds) if heat >= t * (1 + self.h) or i == last
        )

    def down_target(self, heat: float) -> int:
        last = len(self.names) - 1
        return next(
            i for i, t in enumerate(self.thresholds) if heat >= t * (1 - self.h) or i == last
        )

    def ideal(self, heat: float) -> int:
        return next(i for i, t in enumerate(self.thresholds) if heat >= t)

    # -- moves -------------------------------------------------------------------------------
    def fits(self, u: Unit, to: int, mark: str) -> bool:
        slot = self.slots[to]
        return slot.fits(u.cost(to), slot.high if mark == "high" else slot.low)

    def move(self, u: Unit, to: int, kind: str, reason: str) -> None:
        for m in u.members:
            if m.place != to:
                self.slots[m.place].used -= m.size
                self.slots[to].used += m.size
                m.place = to
        u.place = to
        u.kind, u.reason = kind, reason

    def heat_reason(self, u: Unit, to: int) -> str:
        names, h = self.names, self.h
        src, dst = names[u.home], names[to]
        if to < u.home:
            thr = self.thresholds[self.up_target(u.heat)]
            why = f"heat {fmt(u.heat)} ≥ {fmt(thr)}"
            if h:
                why += f" (+{h:.0%} hysteresis)"
            if to != self.up_target(u.heat):
                why += f", {names[self.up_target(u.heat)]} has no room"
            return f"{why}: promote {src} → {dst}"
        thr = self.thresholds[u.home]
        why = f"heat {fmt(u.heat)} < {fmt(thr)}"
        if h:
            why += f" (-{h:.0%} hysteresis)"
        return f"{why}: demote {src} → {dst}"

    def demote(self, u: Unit) -> bool:
        want = self.down_target(u.heat)
        if want <= u.place:
            return False
        for to in range(want, len(self.slots)):
            if self.fits(u, to, "high"):
                self.move(u, to, "demote", self.heat_reason(u, to))
                return True
        return False

    def evict(self, slot: Slot) -> bool:
        # Residents only: a unit that arrived in this plan was admitted under the marks.
        assert slot.quota is not None
        over, moved = slot.used, False
        residents = sorted(
            (u for u in self.units if u.place == slot.rank and u.home == slot.rank),
            key=lambda u: (u.heat, u.id),
        )
        for u in residents:
            if slot.used <= slot.quota * slot.low:
                break
            if not u.eligible or u.pinned is not None:
                continue
            for to in range(max(slot.rank + 1, self.down_target(u.heat)), len(self.slots)):
                if self.fits(u, to, "high"):
                    what = "files" if u.model is None else "models"
                    self.move(
                        u,
                        to,
                        "watermark",
                        f"{slot.name} holds {over} bytes, over its high watermark "
                        f"({slot.high:.0%} of {slot.quota}): demote one of its coldest {what} "
                        f"(heat {fmt(u.heat)}) {slot.name} → {self.names[to]}",
                    )
                    moved = True
                    break
        return moved

    def promote(self, u: Unit) -> bool:
        for to in range(self.up_target(u.heat), u.place):
            if self.fits(u, to, "low"):
                if to == u.home:
                    self.move(u, to, "", "")  # back where it is: the move is cancelled
                else:
                    self.move(u, to, "promote", self.heat_reason(u, to))
                return True
        return False

    def pin(self, u: Unit) -> bool:
        assert u.pinned is not None
        pin = self.rank[u.pinned]
        if not u.movable or (u.place == pin and not u.split) or not self.fits(u, pin, "high"):
            return False
        if pin != u.home:
            self.move(
                u, pin, "pin", f"pinned to {u.pinned}: move {self.names[u.home]} → {u.pinned}"
            )
        else:
            self.move(u, pin, "", "")  # members away from the pin get theirs in member_move
        return True

    def gather(self, u: Unit) -> bool:
        """Bring a model found split across tiers together: where most of it is, else on the
        fastest slower tier with room for all of it."""
        for to in range(u.place, len(self.slots)):
            if self.fits(u, to, "high"):
                self.move(u, to, "", "")  # a gather: its reason is made in member_move
                return True
        return False

    def run(self) -> None:
        """Run to a fixpoint.

        Each step moves a unit towards its heat band (or a pinned unit to its pin, or a tier's
        coldest units off it while it is past its high mark, which only happens before the tier
        first drops under it, or a split model together, once), so the loop ends. At the end
        nothing that wants to move fits anywhere it may go, which is what makes planning again
        after applying the plan yield nothing.
        """
        changed = True
        while changed:
            changed = False
            for u in sorted(self.units, key=lambda u: (u.heat, u.id)):
                if u.eligible and u.pinned is None and self.demote(u):
                    changed = True
            for slot in self.slots:
                if (
                    slot.quota is not None
                    and slot.used > slot.quota * slot.high
                    and self.evict(slot)
                ):
                    changed = True
            for u in sorted(self.units, key=lambda u: (u.pinned is None, -u.heat, u.id)):
                if u.pinned is not None:
                    changed = self.pin(u) or changed
                elif u.eligible and self.up_target(u.heat) < u.place and self.promote(u):
                    changed = True
            for u in self.units:
                if u.split and u.eligible and u.pinned is None and self.gather(u):
                    changed = True

    # -- reading the plan --------------------------------------------------------------------
    def member_move(self, u: Unit, m: Member) -> tuple[str, str]:
        """The kind and reason of member ``m``'s move (which the caller knows it has)."""
        kind, reason = u.kind, u.reason
        if not kind:
            dst = self.names[m.place]
            if u.pinned is not None and m.place == self.rank[u.pinned]:
                kind, reason = "pin", f"pinned to {dst}: move {self.names[m.home]} → {dst}"
            else:
                tiers = sorted({x.home for x in u.members})
                where = ", ".join(self.names[t] for t in tiers)
                kind, reason = "gather", f"its files are split over {where}: gather them on {dst}"
                if m.place != u.home:
                    reason += f" ({self.names[u.home]} has no room for all of them)"
        if u.model is not None:
            reason = f"{u.describe()} moves as one: {reason}"
        return kind, reason
