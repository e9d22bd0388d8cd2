"""This host's copies of shared files on its own directory tiers: the object store stays the
origin.

On a catalog that several hosts write (PostgreSQL), a file on a shared tier (an object store,
whose record names no host) is every host's file. Moving it to one host's NVMe would take it
from all the others, so on such a catalog a shared tier is the fleet's *origin*: its files
never leave it (the storage planner plans no move out of it and a manual move is refused, see
:meth:`HostCopies.refuse_move`), and a host warms such a file by keeping a *copy* of it on one
of its own directory tiers. One file can so be on host A's NVMe, in host B's memory tier and
only in the bucket for host C, at once. On SQLite (one host) nothing here runs: a promotion
out of an object store is the move it always was.

A copy lives in the tier root's reserved directory as ``.tierd-copies/<file id>.<generation>``
(a name no relpath may take, which scan and the watcher skip) and has a row in the catalog's
``copies`` table (this host, the tier's name, the generation), so the fleet can locate it.

The copies directory is a tier of its own (:meth:`~tiering.tiers.Tier.copies` of a tier that
``holds_copies``), so a copy is written, published, read and swept through the tier's
primitives like any file. A fill reads the object through the engine's file operations (ranged
GETs pinned to the ETag the catalog recorded) and writes it through the copies area's writer:
a tierd temp, hashed on the way and checked against the catalog's checksum (an object adopted
from a bucket may have none: the ETag-pinned read then vouches for the bytes, and the catalog
is left as it is), fsynced, published under its final name, the directory fsynced; the row is
recorded last; the row is
refused if the file changed meanwhile, and the copy is then deleted. A drop deletes the row
first, then the file. So a crash at any step leaves the object authoritative and, at worst, a
temp, a file without a row or a row without a file: :meth:`HostCopies.reconcile` (at start)
deletes each, and a second run finds nothing.

A read is served from a copy only while the copy's generation is the record's (every change
of the file's bytes or ETag recorded in the catalog bumps it): a stale copy is never served.

Space: a tier's copies and its own files share the tier's quota and the disk. The bound is
``min(quota, own + copies + free space)``; copies fill while own files plus copies stay under
the low watermark of it, and the coldest are dropped past the high one. The tier's own files
come first: a move or upload counts only them against the quota, and the next pass drops
copies to make up.

Kept whole past 450 lines: a copy's life (reconcile, read, fill, drop) under one lock and index;
the planner's pass and room are in copyplan.py, piece fills in piecefill.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tiering.catalog import Catalog, Copies, FileRecord, FileState
from tiering.catalog.db import Database
from tiering.config import EngineConfig
from tiering.copies.copyfiles import (
    CopyEntry,
    CopyPassReport,
    ReconcileReport,
    copy_heat,
    copy_name,
    sweep,
    write_copy,
)
from tiering.copies.copyplan import CopyPasses
from tiering.copies.piececopy import reset_holdings, write_from_pieces
from tiering.copies.piecefill import FleetFills, PieceFill
from tiering.errors import (
    Conflict,
    FileBusy,
    FileChanged,
    IntegrityError,
    InvalidInput,
    StorageError,
    TierdError,
)
from tiering.moves import Content, FileOps, RateLimiter
from tiering.periodic import Periodic
from tiering.placement.policy import Policy
from tiering.tiers import FillCancelled, Source, Tier, Tiers

__all__ = ["HostCopies", "copy_heat"]

log = logging.getLogger(__name__)

CHUNK = 8 << 20
_CURRENT = (FileState.STABLE, FileState.MIGRATING)  # a move in flight has not changed the bytes


class HostCopies(CopyPasses):
    """This host's copies of origin files on its directory tiers; see the module docstring.

    Parameters
    ----------
    catalog, copies, files:
        The open catalog, its ``copies`` rows, and the file operations fills read through.
    tiers:
        This host's tiers: the shared ones are the origins, those that can hold copies do.
    host:
        This host's id in the ``copies`` table.
    policy:
        The policy in force (each copy tier's ``min_heat``, watermarks, quota).
    quota:
        A tier's quota in force (None: none).
    limiter:
        The migrations' bandwidth cap: the planner's fills count against it.
    fleet:
        With a fleet credential, fills take pieces from peers (:mod:`~tiering.copies.piecefill`).
    """

    def __init__(
        self,
        catalog: Catalog,
        copies: Copies,
        files: FileOps,
        tiers: Tiers,
        *,
        host: str,
        policy: Callable[[], Policy],
        quota: Callable[[Tier], int | None],
        limiter: RateLimiter | None = None,
        fleet: FleetFills | None = None,
    ) -> None:
        self.catalog, self.copies, self.files, self.tiers = catalog, copies, files, tiers
        self.fleet = fleet
        self._fills: dict[int, PieceFill] = {}  # fills from pieces in flight, relaying
        self.host = host
        self._policy = policy
        self._quota = quota
        self.limiter = limiter or RateLimiter()
        self.origins = frozenset(t.name for t in tiers if t.capabilities.shared)
        self.holders = [t for t in tiers if t.capabilities.holds_copies]  # fastest first
        self._index: dict[int, CopyEntry] = {}
        self._lock = threading.Lock()
        self._filling: dict[int, threading.Event] = {}
        self._stopped = threading.Event()  # cancels a fill in flight at stop
        self._pass_lock = threading.Lock()
        self._passes = Periodic(self.run_pass, None, "tierd-copy-fill")
        self.passes = 0
        self.last_pass: CopyPassReport | None = None

    @classmethod
    def build(
        cls,
        db: Database,
        catalog: Catalog,
        files: FileOps,
        tiers: Tiers,
        *,
        policy: Callable[[], Policy],
        quota: Callable[[Tier], int | None],
        limiter: RateLimiter,
        config: EngineConfig | None = None,
    ) -> HostCopies | None:
        """The copy cache, on a catalog several hosts write that has a shared tier and a tier
        that can hold copies; None otherwise (one host: promotions stay moves)."""
        if db.single_writer or db.host is None:
            return None
        caps = [t.capabilities for t in tiers]
        if not any(c.shared for c in caps) or not any(c.holds_copies for c in caps):
            return None
        return cls(
            catalog,
            Copies(db),
            files,
            tiers,
            host=db.host,
            policy=policy,
            quota=quota,
            limiter=limiter,
            fleet=None if config is None else FleetFills.of(db, db.host, config),
        )

    # -- where ---------------------------------------------------------------------------------
    def _area(self, tier: Tier) -> Tier:
        """Where ``tier`` keeps this host's copies."""
        return tier.copies()

    def is_origin(self, tier: str) -> bool:
        return tier in self.origins

    def refuse_move(self, file_id: int, to_tier: str) -> None:
        """Raise :class:`Conflict` for a move of an origin file off its tier."""
        rec = self.catalog.get(file_id)
        if rec.tier in self.origins and to_tier != rec.tier:
            raise Conflict(
                f"{rec.relpath!r} is on {rec.tier}, the fleet's shared origin: its files stay "
                f"there (a move would take it from every host); prefetch it with target nvme "
                "or page_cache for a copy on this host",
                file_id=file_id,
                tier=rec.tier,
            )

    def filling(self, file_id: int) -> PieceFill | None:
        """The fill from pieces of the file in flight here, relaying its verified pieces."""
        with self._lock:
            return self._fills.get(file_id)

    def entries(self) -> list[CopyEntry]:
        with self._lock:
            return list(self._index.values())

    def get(self, file_id: int) -> CopyEntry | None:
        with self._lock:
            return self._index.get(file_id)

    # -- life ----------------------------------------------------------------------------------
    def start(self) -> ReconcileReport:
        """Reconcile the disk with the rows, then start the planner's thread."""
        report = self.reconcile()
        self._stopped.clear()
        self._passes.start()
        return report

    def stop(self) -> None:
        """Stop the planner's thread (a fill in flight is abandoned; its temp is removed).
        Copies and their rows stay: they survive a restart."""
        self._stopped.set()
        self._passes.stop()

    def wake(self) -> None:
        """Run a planner pass soon, on the cache's own thread (the scheduler calls this)."""
        self._passes.wake()

    def reconcile(self) -> ReconcileReport:
        """Make the copies directories and this host's rows agree (before serving): temps go,
        files without a row of their generation go, rows without their file (or of a file that
        changed since) go. Idempotent."""
        report = ReconcileReport()
        names = {t.name for t in self.holders}
        rows = {
            (r.file_id, r.location): r
            for r in self.copies.list(host=self.host)
            if r.location in names
        }
        found: set[tuple[int, str]] = set()
        for tier in self.holders:
            area = self._area(tier)
            if area.reachable():  # no copies area yet: nothing to sweep
                found |= sweep(area, tier.name, rows, report)
        wanted = {fid for fid, _ in rows}
        records = {r.id: r for r in self.catalog.actionable() if r.id in wanted}
        index: dict[int, CopyEntry] = {}
        for (fid, location), row in sorted(rows.items(), key=lambda kv: self._rank(kv[0][1])):
            rec = records.get(fid)
            current = (
                (fid, location) in found
                and rec is not None
                and rec.generation == row.generation
                and rec.state in _CURRENT
                and fid not in index  # one copy a file: the one on the faster tier stays
            )
            if current:
                index[fid] = CopyEntry(fid, row.generation, row.size, location)
                continue
            self.copies.forget(fid, host=self.host, location=location)
            report.rows += 1
            if (fid, location) in found:
                self._area(self.tiers.get(location)).remove(copy_name(fid, row.generation))
                report.files += 1
        with self._lock:
            self._index = index
        if self.fleet is not None:
            reset_holdings(self.fleet, [(e.file_id, e.generation) for e in index.values()])
        report.kept = len(index)
        if report.temps or report.files or report.rows:
            log.info(
                "host copies: reconciled (%d temps, %d files, %d rows removed; %d kept)",
                report.temps,
                report.files,
                report.rows,
                report.kept,
            )
        return report

    def _rank(self, tier: str) -> int:
        return self.tiers.get(tier).rank

    # -- reads ---------------------------------------------------------------------------------
    def open(self, rec: FileRecord) -> Source | None:
        """This host's current copy of ``rec`` opened for reading (the caller closes it), or
        None: no copy, or one of another generation or size (stale: never served), or one
        dropped meanwhile. Its copy file is never renamed over or rewritten (a new generation
        is a new name), so the source serves the copy it opened."""
        e = self.get(rec.id)
        if e is None or e.generation != rec.generation or e.size != rec.size:
            return None
        if rec.state not in _CURRENT:
            return None
        area = self._area(self.tiers.get(e.tier))
        try:
            src = area.open(copy_name(e.file_id, e.generation))
        except (TierdError, OSError):
            return None  # dropped between the look-up and the open: read the origin
        if src.size != rec.size:
            src.close()
            return None
        return src

    def content(self, file_id: int) -> Content | None:
        """A current copy of the file as the engine's :class:`~tiering.moves.Content`, or None."""
        if self.get(file_id) is None:
            return None
        rec = self.catalog.get(file_id, cached=True)
        src = self.open(rec)
        return None if src is None else Content(rec, src)

    # -- fills and drops -----------------------------------------------------------------------
    def fill(
        self,
        file_id: int,
        tier: str,
        *,
        cancel: threading.Event | None = None,
        progress: Callable[[int], None] | None = None,
        throttle: bool = False,
        keep_s: float = 0.0,
        sources: Callable[[str, int], None] | None = None,
    ) -> CopyEntry:
        """Copy an origin file to directory tier ``tier`` (or find its current copy there).

        ``keep_s`` keeps the copy that long whatever its heat (a prefetch). Colder copies on
        the tier are dropped for room. ``sources`` is told the bytes taken from each source
        (``bucket``, ``peer:<host>``).

        Raises
        ------
        FileNotFound, InvalidInput
            No such file, or it is not on an origin tier, or ``tier`` cannot hold copies.
        FileBusy
            The file is not stable.
        FileChanged, IntegrityError
            It changed during the copy, or its bytes are not the catalog's: nothing kept.
        InsufficientSpace
            No room on the tier (its own files and hotter copies fill it).
        FillCancelled
            ``cancel`` was set, or the cache stopped.
        """
        dest = self.tiers.get(tier)
        if not dest.capabilities.holds_copies:
            raise InvalidInput(f"tier {tier} cannot hold a copy of a shared file")
        while True:
            rec = self.catalog.get(file_id)
            if rec.tier not in self.origins:
                raise InvalidInput(f"{rec.relpath!r} is on {rec.tier}, not on a shared tier")
            if rec.state != FileState.STABLE:
                raise FileBusy(
                    f"{rec.relpath!r} is {rec.state}: only a stable file is copied",
                    file_id=file_id,
                    path=rec.relpath,
                )
            e = self.get(file_id)
            if e is not None and e.generation == rec.generation and e.tier == tier:
                if keep_s > 0:
                    e.keep_until = max(e.keep_until, time.time() + keep_s)
                return e
            with self._lock:
                other = self._filling.get(file_id)
                if other is None:
                    mine = self._filling[file_id] = threading.Event()
                    break
            while not other.wait(0.05):  # another fill of this file: take its copy after it
                if (cancel is not None and cancel.is_set()) or self._stopped.is_set():
                    raise FillCancelled
        try:
            self._make_room(dest, rec)
            return self._fill(rec, dest, cancel, progress, throttle, keep_s, sources)
        finally:
            with self._lock:
                del self._filling[file_id]
            mine.set()

    def _fill(
        self,
        rec: FileRecord,
        dest: Tier,
        cancel: threading.Event | None,
        progress: Callable[[int], None] | None,
        throttle: bool,
        keep_s: float,
        sources: Callable[[str, int], None] | None,
    ) -> CopyEntry:
        """Write ``rec``'s copy on ``dest``, then record it (the copy goes if the file changed
        meanwhile) and index it, in place of any copy it replaces."""
        name = copy_name(rec.id, rec.generation)

        def stop() -> bool:
            return (cancel is not None and cancel.is_set()) or self._stopped.is_set()

        limit = (lambda k: self.limiter.acquire(k, cancel)) if throttle else None
        try:
            self._write(rec, self._area(dest), name, stop, limit, progress, sources)
        except IntegrityError as exc:
            raise IntegrityError(
                f"{rec.relpath!r} on {rec.tier} does not match the catalog's checksum "
                f"({exc.message}); not copied",
                file_id=rec.id,
                path=rec.relpath,
            ) from exc
        except OSError as exc:
            raise StorageError(f"copying {rec.relpath!r} to {dest.name} failed: {exc}") from exc
        recorded = self.copies.record(
            rec.id,
            host=self.host,
            location=dest.name,
            generation=rec.generation,
            size=rec.size,
            states=_CURRENT,
        )
        if not recorded:
            self._area(dest).remove(name)
            raise FileChanged(f"{rec.relpath!r} changed while it was copied")
        keep_until = time.time() + keep_s if keep_s > 0 else 0.0  # 0: kept for its heat only
        entry = CopyEntry(rec.id, rec.generation, rec.size, dest.name, keep_until)
        with self._lock:
            old, self._index[rec.id] = self._index.get(rec.id), entry
        if old is not None and (old.tier, old.generation) != (dest.name, rec.generation):
            self._remove(old)  # the copy it replaces (another tier or generation)
        return entry

    def _write(
        self,
        rec: FileRecord,
        area: Tier,
        name: str,
        stop: Callable[[], bool],
        limit: Callable[[int], None] | None,
        progress: Callable[[int], None] | None,
        sources: Callable[[str, int], None] | None,
    ) -> None:
        """The copy's bytes into ``area`` as ``name``: from pieces (peers, and the bucket for
        what none gives) on a fleet with a credential, else from the bucket."""
        area.check()  # the copies directory, made durably on the first fill
        if self.fleet is not None:
            write_from_pieces(
                self.fleet,
                rec,
                area,
                name,
                open_origin=lambda: self._origin(rec),
                stop=stop,
                throttle=limit,
                progress=progress,
                sources=sources,
                serving=lambda fill: self._relaying(rec.id, fill),
            )
            return
        with self._origin(rec) as src:
            write_copy(
                src,
                area,
                name,
                size=rec.size,
                checksum=rec.checksum,
                stop=stop,
                throttle=limit,
                progress=progress,
            )
        if sources is not None:
            sources("bucket", rec.size)

    def _origin(self, rec: FileRecord) -> Source:
        """``rec``'s bytes on its origin, at its generation."""
        content = self.files.open_content(rec.id)  # a HEAD: a changed object fails here
        if content.record.generation != rec.generation:
            content.close()
            raise FileChanged(f"{rec.relpath!r} changed before it was copied")
        return content.source

    def _relaying(self, file_id: int, fill: PieceFill | None) -> None:
        """``fill`` serves its verified pieces to peers now (None: no more)."""
        with self._lock:
            self._fills.pop(file_id, None)
            if fill is not None:
                self._fills[file_id] = fill

    def drop(self, file_id: int, reason: str = "dropped") -> bool:
        """Drop the file's copy, if any: its row first, then the file (a read that opened it
        goes on reading the unlinked file)."""
        with self._lock:
            e = self._index.pop(file_id, None)
        if e is None:
            return False
        self.copies.forget(file_id, host=self.host, location=e.tier)
        if self.fleet is not None:  # its pieces are served from here no more
            self.fleet.pieces.forget(file_id, host=self.host)
        self._remove(e)
        log.debug("host copies: dropped file %d from %s (%s)", file_id, e.tier, reason)
        return True

    def _remove(self, e: CopyEntry) -> None:
        self._area(self.tiers.get(e.tier)).remove(copy_name(e.file_id, e.generation))
