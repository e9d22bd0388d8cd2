"""The copy planner's pass of :class:`~tiering.copies.hostcopies.HostCopies` (a mixin), and the
room it plans in: per directory tier, fastest first, which origin files to copy there and which
copies to drop, by :func:`~tiering.placement.cache.plan_cache` over the room the tier's own files
leave; and, for one fill, the colder copies dropped to make room for it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tiering.catalog import Catalog, FileRecord, FileState
from tiering.copies.copyfiles import CopyEntry, CopyPassReport, copy_heat
from tiering.errors import (
    FileBusy,
    FileChanged,
    InsufficientSpace,
    IntegrityError,
    InvalidInput,
    StorageError,
)
from tiering.placement.cache import CachedCopy, CachePlan, plan_cache
from tiering.placement.fleetheat import LocalHeat, local_heat
from tiering.placement.policy import Policy
from tiering.tiers import FillCancelled, Tier

__all__ = ["CopyPasses"]

log = logging.getLogger("tiering.copies.hostcopies")


class CopyPasses:
    """The planner's pass; what it needs of the cache is declared here, defined there."""

    catalog: Catalog
    holders: list[Tier]
    origins: frozenset[str]
    _policy: Callable[[], Policy]
    _pass_lock: threading.Lock
    _stopped: threading.Event
    passes: int
    last_pass: CopyPassReport | None
    host: str
    _quota: Callable[[Tier], int | None]

    def entries(self) -> list[CopyEntry]:
        raise NotImplementedError

    def get(self, file_id: int) -> CopyEntry | None:
        raise NotImplementedError

    def fill(self, file_id: int, tier: str, *, throttle: bool = False) -> CopyEntry:
        raise NotImplementedError

    def drop(self, file_id: int, reason: str = "dropped") -> bool:
        raise NotImplementedError

    def _rank(self, tier: str) -> int:
        raise NotImplementedError

    def plan(self, now: float | None = None) -> dict[str, CachePlan]:
        """Per directory tier, fastest first, the copies to fill and drop now (a dry run).

        Each tier's copies follow :func:`~tiering.placement.cache.plan_cache` with that tier's
        ``min_heat`` and watermarks, over the bound its own files leave; a file with a copy (or
        a fill) on a faster tier is not planned on a slower one (its copy there is dropped).
        """
        now = time.time() if now is None else now
        policy = self._policy()
        local = local_heat(self.catalog)  # this host's heat, read once a pass
        records = self.catalog.actionable()
        taken: set[int] = set()
        out: dict[str, CachePlan] = {}
        for tier in self.holders:
            rule = policy.tiers.get(tier.name)
            if rule is None:
                continue
            files = [
                r
                for r in records
                if r.tier in self.origins and r.id not in taken and self._rank(r.tier) > tier.rank
            ]
            held = [
                CachedCopy(e.file_id, e.generation, e.size, keep_until=e.keep_until)
                for e in self.entries()
                if e.tier == tier.name
            ]
            cap, own, _mine = self._space(tier, records)
            high = max(0.0, (cap * rule.high_watermark - own) / cap) if cap > 0 else 0.0
            low = max(0.0, (cap * rule.low_watermark - own) / cap) if cap > 0 else 0.0
            shared = rule.model_copy(
                update={"quota_bytes": cap, "high_watermark": high, "low_watermark": low}
            )
            view = policy.model_copy(update={"tiers": {**policy.tiers, tier.name: shared}})
            plan = plan_cache(
                files,
                view,
                tier.name,
                held,
                now,
                heat_of=lambda f: copy_heat(f, policy, now, local),
            )
            dropped = {d.file_id for d in plan.drops}
            taken |= {c.file_id for c in held if c.file_id not in dropped}
            taken |= {f.file_id for f in plan.fills}
            out[tier.name] = plan
        return out

    def run_pass(self, now: float | None = None) -> CopyPassReport:
        """Plan, then drop and fill (fills one at a time, under the bandwidth cap)."""
        with self._pass_lock:
            report = CopyPassReport(started_at=time.time())
            report.plans = plans = self.plan(now)
            for plan in plans.values():
                for d in plan.drops:
                    e = self.get(d.file_id)
                    if e is not None and self.drop(d.file_id, d.code):
                        report.dropped.append(d.file_id)
            for tier, plan in plans.items():
                for f in plan.fills:
                    if self._stopped.is_set():
                        break
                    try:
                        self.fill(f.file_id, tier, throttle=True)
                    except FillCancelled:
                        break
                    except (InvalidInput, FileBusy, FileChanged, IntegrityError) as exc:
                        report.failed.append((f.file_id, exc.message))
                        continue
                    except (InsufficientSpace, StorageError) as exc:
                        report.failed.append((f.file_id, exc.message))
                        log.info("host copies: not filled %d: %s", f.file_id, exc.message)
                        continue
                    report.filled.append(f.file_id)
            self.passes += 1
            self.last_pass = report
            return report

    # -- room ----------------------------------------------------------------------------------
    def _space(self, tier: Tier, records: list[FileRecord]) -> tuple[int, int, int]:
        """(the bound of own files plus copies, own files' bytes, copies' bytes) on ``tier``."""
        own = sum(
            r.size
            for r in records
            if r.tier == tier.name and r.host == self.host and r.state != FileState.MISSING
        )
        mine = sum(e.size for e in self.entries() if e.tier == tier.name)
        cap = own + mine + max(0, tier.space().free)
        quota = self._quota(tier)
        return (cap if quota is None else min(cap, quota)), own, mine

    def _make_room(self, dest: Tier, rec: FileRecord) -> None:
        """Drop copies on ``dest`` colder than ``rec`` (no prefetch keeps) until it fits."""
        cap, own, mine = self._space(dest, self.catalog.actionable())
        need = own + mine + rec.size - cap
        if need <= 0:
            return
        policy, now, local = self._policy(), time.time(), local_heat(self.catalog)
        heat = copy_heat(rec, policy, now, local)
        colder = sorted(
            (
                (self._heat_of(e.file_id, policy, now, local), e)
                for e in self.entries()
                if e.tier == dest.name and e.keep_until <= now and e.file_id != rec.id
            ),
            key=lambda he: he[0],
        )
        victims: list[CopyEntry] = []
        for h, e in colder:
            if need <= 0 or h >= heat:
                break
            victims.append(e)
            need -= e.size
        if need > 0:
            raise InsufficientSpace(
                f"tier {dest.name} has no room for a copy of {rec.relpath!r} ({rec.size} bytes): "
                "its own files and hotter copies fill it",
                tier=dest.name,
                free=max(0, cap - own - mine),
            )
        for e in victims:
            self.drop(e.file_id, "room")

    def _heat_of(self, file_id: int, policy: Policy, now: float, local: LocalHeat | None) -> float:
        try:
            return copy_heat(self.catalog.get(file_id, cached=True), policy, now, local)
        except Exception:
            return -1.0  # gone: the coldest of all
