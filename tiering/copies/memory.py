"""The memory tier bound to the catalog: fills, drops and the cache's background work.

:class:`MemoryCache` is what the engine exposes as ``engine.memory``. It fills copies of
files into its :class:`~tiering.tiers.MemoryTier` from their storage tier (verifying each
against the catalog's checksum), records each complete copy in the catalog's ``copies``
table and forgets it when the copy goes, and runs two background jobs: the cache planner's
passes (:func:`~tiering.placement.cache.plan_cache`, woken by the scheduler) and the watch on
the host's free memory (under its floor, the coldest copies no load holds are dropped).

On a fleet, a fill of a shared file takes its bytes through this host's copy of it on a
directory tier, made from the pieces the hosts exchange where there is none, so hosts filling
their memory with one model at once make the bucket send it about once (see
:mod:`~tiering.copies.fillsource`).

On a catalog several hosts share, a file on a shared (object-store) tier is ranked by the heat
policy ``promotion_heat`` names, this host's own or the fleet's (see
:mod:`~tiering.placement.fleetheat`), in the planner's passes and in the order copies are
dropped for room, so a host's memory follows the same rule as its copies on disk. Only files
this host can read are planned: another host's files are on disks it cannot reach.

The ``files`` table never names the memory tier: a file's tier is where its authoritative
bytes are, and a copy in memory is only ever a cache of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tiering.catalog import Catalog, Copies, FileRecord, FileState
from tiering.config import EngineConfig
from tiering.copies.fillsource import FillProgress, FillSource
from tiering.errors import FileBusy, FileChanged, IntegrityError, TierdError
from tiering.moves import FileOps, RateLimiter
from tiering.periodic import Periodic
from tiering.placement.cache import CachedCopy, CachePlan, plan_cache
from tiering.placement.fleetheat import LocalHeat, heat_for_promotion, local_heat
from tiering.placement.policy import Policy
from tiering.tiers import FillCancelled, MemoryEntry, MemoryTier

__all__ = ["CachePassReport", "MemoryCache"]

log = logging.getLogger(__name__)


@dataclass
class CachePassReport:
    """What one pass of the cache planner did."""

    started_at: float
    plan: CachePlan = field(default_factory=CachePlan)
    filled: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)


class MemoryCache:
    """A memory tier, its catalog rows and its background work; see the module docstring.

    Parameters
    ----------
    tier:
        The memory tier (its ``on_drop`` is taken over).
    host:
        This host's id in the ``copies`` table.
    policy:
        The policy in force (with rules for the tier).
    limiter:
        The migrations' bandwidth cap: the planner's fills count against it.
    pressure_interval_s:
        How often the host's free memory is checked.
    """

    def __init__(
        self,
        tier: MemoryTier,
        *,
        host: str,
        policy: Callable[[], Policy],
        limiter: RateLimiter | None = None,
        pressure_interval_s: float = 1.0,
    ) -> None:
        self.tier = tier
        self.host = host
        self._policy = policy
        self.limiter = limiter or RateLimiter()
        self._catalog: Catalog | None = None
        self._copies: Copies | None = None
        #: Where a fill's bytes come from (this host's copy, a peer, the file's tier): the
        #: engine sets its ``host_copies``, the serving layer its ``peer_source``.
        self.source = FillSource(tier.name)
        tier.on_drop = self._forget
        self._stopped = threading.Event()  # cancels a fill in flight at stop
        self._passes = Periodic(self.run_pass, None, "tierd-memory-fill")
        self._pass_lock = threading.Lock()  # one pass at a time (its thread's, or a caller's)
        self._pressure = Periodic(self.relieve_pressure, pressure_interval_s, "tierd-memory-watch")
        self.passes = 0
        self.last_pass: CachePassReport | None = None

    @classmethod
    def build(
        cls, config: EngineConfig, *, policy: Callable[[], Policy], limiter: RateLimiter
    ) -> MemoryCache | None:
        """The memory cache ``config`` describes (None when it has no memory tier)."""
        if config.memory is None:
            return None
        tier = MemoryTier(config.memory, floor_bytes=config.memory_floor_bytes)
        return cls(
            tier,
            host=config.host_id,
            policy=policy,
            limiter=limiter,
            pressure_interval_s=config.memory_pressure_interval_s,
        )

    # -- what callers read ---------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.tier.name

    @property
    def quota_bytes(self) -> int:
        """The quota in force: the policy's for the tier, capped by the configured one (the
        memory budget that start checked against the host); the configured one by default."""
        budget = self.tier.config.quota_bytes
        assert budget is not None
        rule = self._policy().tiers.get(self.name)
        if rule is not None and rule.quota_bytes is not None:
            return min(rule.quota_bytes, budget)
        return budget

    def _sync_quota(self) -> None:
        # The tier enforces what the policy in force says (read at each fill and pass).
        self.tier.quota_bytes = self.quota_bytes

    def entries(self) -> list[MemoryEntry]:
        return self.tier.entries()

    # -- life ----------------------------------------------------------------------------------
    def open(self, catalog: Catalog, copies: Copies, files: FileOps) -> None:
        """Bind to the open catalog (the engine's ``open``)."""
        self._catalog, self._copies, self.source.files = catalog, copies, files

    def start(self, keep_locations: list[str]) -> int:
        """Forget this host's copies the catalog still lists (memory did not survive the
        restart; rows at ``keep_locations`` are not in memory and stay), then start the
        background work. Returns how many rows went."""
        self.tier.reopen()
        gone = self._rows().forget_host(self.host, keep=keep_locations)
        if gone:
            log.info("memory tier %s: forgot %d copies held before the restart", self.name, gone)
        self._stopped.clear()
        self._passes.start()
        self._pressure.start()
        return gone

    def stop(self) -> None:
        """Stop the background work (a fill in flight is abandoned) and drop every copy."""
        self._stopped.set()
        self._pressure.stop()
        self._passes.stop()
        copies, self._copies = self._copies, None  # one delete below, not one per copy
        try:
            self.tier.close()
            if copies is not None:
                copies.forget_host(self.host, location=self.name)
        except Exception:  # the engine goes on stopping; a restart forgets the rows anyway
            log.exception("memory tier %s: dropping its copies failed", self.name)
        finally:
            self._copies = copies

    def wake(self) -> None:
        """Run a planner pass soon, on the cache's own thread (the scheduler calls this)."""
        self._passes.wake()

    # -- catalog -------------------------------------------------------------------------------
    def _cat(self) -> Catalog:
        if self._catalog is None:
            raise RuntimeError("the memory tier is not bound to a catalog")
        return self._catalog

    def _rows(self) -> Copies:
        if self._copies is None:
            raise RuntimeError("the memory tier is not bound to a catalog")
        return self._copies

    def _forget(self, entry: MemoryEntry, reason: str) -> None:
        if self._copies is None:
            return
        self._copies.forget(entry.file_id, host=self.host, location=self.name)
        log.debug("memory tier %s: dropped file %d (%s)", self.name, entry.file_id, reason)

    def _heat(self, file_id: int, policy: Policy, now: float, local: LocalHeat | None) -> float:
        try:
            rec = self._cat().get(file_id, cached=True)
        except TierdError:
            return -1.0  # gone: the coldest of all
        return heat_for_promotion(policy, rec, now, local)

    # -- fills and drops -----------------------------------------------------------------------
    def fill(
        self,
        file_id: int,
        *,
        cancel: threading.Event | None = None,
        progress: Callable[[int], None] | None = None,
        throttle: bool = False,
        keep_s: float = 0.0,
        sources: Callable[[str, int], None] | None = None,
    ) -> MemoryEntry:
        """Copy a stable file into memory (or find its current copy there); returns the copy.

        The whole file is read from its tier (a fleet's shared file: through this host's copy
        of it, see the module docstring) and hashed on the way; the copy is kept only if the
        hash is the catalog's checksum and the file is still at the generation read. Colder
        copies no load holds are dropped for room if the quota is short. ``keep_s`` keeps the
        copy that long whatever its heat (a prefetch); ``throttle`` counts the bytes against
        the migrations' bandwidth cap; ``sources`` is told the bytes taken from each source
        of a shared file (``bucket``, ``peer:<host>``), as a host copy's fill tells them.

        Raises
        ------
        FileNotFound
        FileBusy
            The file is not stable (migrating, missing, in conflict).
        FileChanged, IntegrityError
            The file changed during the copy, or its bytes are not the catalog's: nothing kept.
        InsufficientSpace
            No room under the quota (nothing colder to drop) or host memory is low.
        FillCancelled
            ``cancel`` was set, or the cache stopped.
        """
        self._sync_quota()
        stop = _either(cancel, self._stopped)
        keep_until = time.time() + keep_s if keep_s > 0 else 0.0
        while True:
            rec = self._cat().get(file_id)
            if rec.state != FileState.STABLE:
                raise FileBusy(
                    f"{rec.relpath!r} is {rec.state}: only a stable file is copied into memory",
                    file_id=file_id,
                    path=rec.relpath,
                )
            found = self.tier.get(file_id)
            if found is not None and found.generation == rec.generation:
                found.keep_until = max(found.keep_until, keep_until)
                return found
            in_flight = self.tier.filling(file_id)
            if in_flight is None:
                break
            # Another fill of this file is under way: its copy is as good as ours.
            while not in_flight.wait(0.05):
                if stop.is_set():
                    raise FillCancelled
        now, policy, local = time.time(), self._policy(), local_heat(self._cat())
        entry = self.tier.reserve(
            file_id,
            rec.generation,
            rec.size,
            order=lambda e: self._heat(e.file_id, policy, now, local),
            colder_than=heat_for_promotion(policy, rec, now, local),
        )
        try:
            told = FillProgress(rec.size, progress)
            return self._fill(rec, entry, stop, told, throttle, keep_s, sources)
        except BaseException:
            self.tier.abort(entry)
            raise

    def _fill(
        self,
        rec: FileRecord,
        entry: MemoryEntry,
        stop: threading.Event,
        progress: FillProgress,
        throttle: bool,
        keep_s: float,
        sources: Callable[[str, int], None] | None,
    ) -> MemoryEntry:
        limit = (lambda n: self.limiter.acquire(n, stop)) if throttle else None
        source = self.source.open(
            rec, stop=stop, progress=progress, throttle=throttle, keep_s=keep_s, sources=sources
        )
        with source:
            checksum = self.tier.fill(entry, source, cancel=stop, throttle=limit, progress=progress)
        keep_until = time.time() + keep_s if keep_s > 0 else 0.0  # from when it is in memory
        if rec.checksum is not None and checksum != rec.checksum:
            raise IntegrityError(
                f"{rec.relpath!r} on {rec.tier} does not match the catalog's checksum (read "
                f"{checksum}, catalog {rec.checksum}): it changed behind tierd's back; not "
                "copied into memory",
                file_id=rec.id,
                path=rec.relpath,
            )
        recorded = self._rows().record(
            rec.id,
            host=self.host,
            location=self.name,
            generation=rec.generation,
            size=rec.size,
            states=(FileState.STABLE, FileState.MIGRATING),
        )
        if not recorded:
            raise FileChanged(f"{rec.relpath!r} changed while it was copied into memory")
        try:
            return self.tier.commit(entry, keep_until=keep_until)
        except FillCancelled:
            self._forget(entry, "stop")
            raise

    def drop(self, file_id: int, reason: str = "dropped") -> bool:
        """Drop the file's copy, if any (freed now, or when the last load releases it)."""
        return self.tier.drop(file_id, reason)

    def relieve_pressure(self) -> list[MemoryEntry]:
        """Under the host's free-memory floor: drop the coldest copies no load holds."""
        need = self.tier.pressure()
        if need <= 0:
            return []
        now, policy, local = time.time(), self._policy(), local_heat(self._cat())
        dropped = self.tier.relieve(need, order=lambda e: self._heat(e.file_id, policy, now, local))
        if dropped:
            log.warning(
                "memory tier %s: host memory under its floor; dropped %d copies (%d bytes)",
                self.name,
                len(dropped),
                sum(e.size for e in dropped),
            )
        return dropped

    # -- the planner's pass --------------------------------------------------------------------
    def plan(self, now: float | None = None) -> CachePlan:
        """What the cache planner wants now (a dry run)."""
        now = time.time() if now is None else now
        self._sync_quota()
        copies = [
            CachedCopy(e.file_id, e.generation, e.size, e.refs > 0, e.keep_until)
            for e in self.tier.entries()
        ]
        policy = self._policy()
        rule = policy.tiers[self.name].model_copy(update={"quota_bytes": self.tier.quota_bytes})
        policy = policy.model_copy(update={"tiers": {**policy.tiers, self.name: rule}})
        local = local_heat(self._cat())  # this host's heat of shared files, read once a pass
        return plan_cache(
            self._cat().actionable(),  # another host's files are on disks it cannot reach
            policy,
            self.name,
            copies,
            now,
            heat_of=lambda f: heat_for_promotion(policy, f, now, local),
        )

    def run_pass(self, now: float | None = None) -> CachePassReport:
        """Plan, then drop and fill (fills one at a time, under the bandwidth cap)."""
        with self._pass_lock:
            return self._run_pass(now)

    def _run_pass(self, now: float | None) -> CachePassReport:
        report = CachePassReport(started_at=time.time())
        report.plan = plan = self.plan(now)
        for d in plan.drops:
            if self.tier.drop(d.file_id, d.code):
                report.dropped.append(d.file_id)
        for f in plan.fills:
            if self._stopped.is_set():
                break
            try:
                self.fill(f.file_id, throttle=True)
            except FillCancelled:
                break
            except TierdError as exc:
                report.failed.append((f.file_id, exc.message))
                log.info("memory tier %s: not filled %d: %s", self.name, f.file_id, exc.message)
                continue
            report.filled.append(f.file_id)
        self.passes += 1
        self.last_pass = report
        return report


def _either(a: threading.Event | None, b: threading.Event) -> threading.Event:
    """An event set when ``a`` or ``b`` is (polled by the copy between chunks)."""
    if a is None:
        return b
    return _Either(a, b)


class _Either(threading.Event):
    def __init__(self, a: threading.Event, b: threading.Event) -> None:
        super().__init__()
        self._a, self._b = a, b

    def is_set(self) -> bool:
        return self._a.is_set() or self._b.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._a.wait(0.05 if left is None else min(0.05, left))
        return True
