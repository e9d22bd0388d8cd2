"""The copy planner's pass of :class:`~tiering.copies.hostcopies.HostCopies` (a mixin):
per directory tier, fastest first, which origin files to copy there and which copies to drop,
by :func:`~tiering.placement.cache.plan_cache` over the room the tier's own files leave."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tiering.catalog import Catalog, FileRecord
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
from tiering.placement.fleetheat import local_heat
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

    def _space(self, tier: Tier, records: list[FileRecord]) -> tuple[int, int, int]:
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
