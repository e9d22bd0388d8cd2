"""Reconcile the catalog with what is in the tiers.

Adopts files placed in a tier from outside (an existing bucket prefix becomes tierd-managed
in one pass: objects are adopted from the listing, by size, time and ETag, without reading
their bytes; local files are hashed), notices files changed in place or moved by hand
between tiers, marks records whose bytes vanished as ``missing``, and reports a relpath present
in two tiers as a ``conflict``. It never deletes a user's file. With ``check=True`` it only
reports the drift.

Hosts sharing one catalog each reconcile only their own records: those of files on their own
tiers (``host`` is this host) and on shared ones (object stores, no host). Another host's files
are on disks this host cannot see, so their absence here says nothing; a relpath this host finds
on its own tier while another host holds its record is reported as a conflict and left alone
(relpaths are unique across the fleet, and adopting it would take the other host's record).

A scan holds a bounded amount, however many files there are (a bucket of millions of objects):
every tier walks in relpath order and the catalog is read in relpath order a page at a time, so
one merge of those streams meets each relpath once, with its places and its record, and
decisions are applied in batches as it goes. Only the report grows, with the drift it names.

Kept whole past 450 lines: one streamed pass over every tier root and the catalog, whose phases
share the cursor and the report.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import groupby
from operator import itemgetter

from tiering.catalog import Catalog, FileRecord, FileState, NewFile
from tiering.errors import IntegrityError, TierdError
from tiering.integrity import DAMAGED, DamageLog
from tiering.sync.found import entry_version, listed_record, record_of
from tiering.sync.report import ScanReport
from tiering.tiers import Tier, WalkEntry

__all__ = ["ScanReport", "owned_by_this_host", "reconcile_paths", "scan"]

log = logging.getLogger(__name__)


Place = tuple[Tier, WalkEntry]
BATCH = 256  # files hashed, then recorded in one catalog transaction; records read at a time
# A record adopted this recently, never read, is taken for the new name of a file that vanished
# with the same content (the events of one rename can arrive in two passes).
RENAME_WINDOW_S = 120.0


class _Pacer:
    """Sleeps so that at most ``per_s`` files a second are reconciled (None: no limit)."""

    def __init__(self, per_s: float | None) -> None:
        self.interval = 1.0 / per_s if per_s else 0.0
        self.next_at = time.monotonic()

    def __call__(self) -> None:
        if not self.interval:
            return
        self.next_at += self.interval
        delay = self.next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        elif delay < -1.0:
            self.next_at = time.monotonic()  # do not burst to catch up after a stall


def owned_by_this_host(catalog: Catalog) -> Callable[[FileRecord], bool]:
    """Whether a record is this host's to reconcile: on one of its own tiers, or on a shared
    tier (no host). A catalog that names no host (a library use) owns every record."""
    me = catalog.db.host
    if me is None:
        return lambda rec: True
    return lambda rec: rec.host is None or rec.host == me


class _Reconciler:
    """Decides per relpath, and applies the decisions in batches (one transaction per batch,
    so adopting 10,000 files costs tens of commits, not 10,000). It holds at most a batch of
    each kind of decision: new files and vanished ones are matched as renames a batch at a
    time, and a rename whose halves fall in two batches is still found (the vanished record
    is ``missing`` by then, or the new one was adopted moments ago: see
    :meth:`_match_renames`)."""

    def __init__(
        self,
        catalog: Catalog,
        tiers: Iterable[Tier],
        report: ScanReport,
        *,
        check: bool,
        batch: int = BATCH,
        damage: DamageLog | None = None,
    ) -> None:
        self.catalog = catalog
        self.damage = damage or DamageLog()
        self.damaged: set[tuple[str, str]] = set()  # (tier, relpath) found damaged this pass
        self.ours = owned_by_this_host(catalog)
        self.tiers = {t.name: t for t in tiers}
        self.report = report
        self.check = check
        self.batch = batch
        self.busy = catalog.busy_file_ids()
        self._place: list[Place] = []
        self._adopt: list[Place] = []  # new files: each may be the new name of a gone one
        self._gone: list[FileRecord] = []

    def __call__(self, relpath: str, places: list[Place], rec: FileRecord | None) -> None:
        report = self.report
        if rec is not None and not self.ours(rec):
            if places:
                self._foreign(relpath, places, rec)
            return  # its bytes are on another host's disks: not ours to judge
        if rec is not None and rec.tier in self.report.failed:
            return  # its tier could not be listed: nothing is known of its files this pass
        if rec is not None and (rec.state == FileState.MIGRATING or rec.id in self.busy):
            self._skip(relpath, "moving")  # the mover owns it until its intent closes
            return
        unusable = [(t, e) for t, e in places if e.skipped is not None]
        if unusable:
            self._skip(relpath, f"{unusable[0][1].skipped} (tier {unusable[0][0].name})")
            places = [(t, e) for t, e in places if e.skipped is None]
        for tier, entry in places:
            found = self.damage.known(tier.name, relpath, entry_version(entry))
            if found is not None:  # this version was found damaged: hashing it again finds so
                self.damaged.add((tier.name, relpath))
                self._skip(relpath, f"{DAMAGED}{found.reason} (not read again until it changes)")
                return
        if not places:
            for tier in self.tiers.values():
                self.damage.clear(tier.name, relpath)
            if rec is not None and rec.state != FileState.MISSING:
                report.missing.append(relpath)
                if not self.check:
                    self._gone.append(rec)
                    if len(self._gone) >= self.batch:
                        self._settle()
            return
        if len(places) > 1:
            self._conflict(relpath, places, rec)
            return
        tier, entry = places[0]
        if rec is None:
            report.adopted.append(relpath)
        elif rec.tier != tier.name:
            report.moved.append(relpath)
        elif (
            (rec.stored_size if entry.codec else rec.size) != entry.size
            or rec.mtime_ns != entry.mtime_ns
            or rec.etag != entry.etag
            or (rec.checksum is None and entry.etag is None)
        ):
            report.changed.append(relpath)
        elif rec.state != FileState.STABLE:
            report.changed.append(relpath)  # back from missing or conflict
        else:
            report.unchanged += 1
            return
        if self.check:
            return
        if rec is None:
            self._adopt.append((tier, entry))
            if len(self._adopt) >= self.batch:
                self._settle()
            return
        self._place.append((tier, entry))
        if len(self._place) >= self.batch:
            self._flush_places()

    def _conflict(self, relpath: str, places: list[Place], rec: FileRecord | None) -> None:
        names = [t.name for t, _ in places]
        self.report.conflicts[relpath] = names
        log.warning("conflict: %r is present in tiers %s; nothing was deleted", relpath, names)
        if self.check:
            return
        try:
            if rec is None:
                # Adopt the copy on the fastest tier so the file is known; flag the rest.
                rec = self.catalog.upsert(record_of(places[0][0], relpath))
            detail = "present in tiers " + ", ".join(names)
            if rec is not None and (rec.state != FileState.CONFLICT or rec.detail != detail):
                self.catalog.set_state([rec.id], FileState.CONFLICT, detail)
        except (TierdError, OSError) as exc:
            log.warning("could not record conflict for %r: %s", relpath, exc)

    def _foreign(self, relpath: str, places: list[Place], rec: FileRecord) -> None:
        names = [t.name for t, _ in places] + [f"{rec.tier}@{rec.host}"]
        self.report.conflicts[relpath] = names
        log.warning(
            "conflict: %r is in this host's tiers %s, but host %r holds its record (on %s); "
            "nothing was adopted or deleted",
            relpath,
            names[:-1],
            rec.host,
            rec.tier,
        )

    def _skip(self, relpath: str, why: str) -> None:
        self.report.skipped.append(relpath)
        self.report.reasons[relpath] = why

    def _damaged(self, tier: Tier, entry: WalkEntry, exc: IntegrityError) -> None:
        """Damage found hashing a file: skipped (never ``changed`` or ``adopted``), its record
        quarantined once; the same version is not hashed again (see tiering.integrity)."""
        relpath = entry.relpath
        for decided in (self.report.adopted, self.report.changed, self.report.moved):
            if relpath in decided[-self.batch * 2 :]:
                decided.remove(relpath)
        self._skip(relpath, DAMAGED + exc.message)
        self.damaged.add((tier.name, relpath))
        rec = self.catalog.find(relpath)
        self.damage.note(
            tier.name,
            relpath,
            entry_version(entry),
            exc,
            file_id=rec.id if rec is not None and self.ours(rec) else None,
            quarantine=self._quarantine,
        )

    def _quarantine(self, file_id: int, detail: str) -> None:
        self.catalog.set_state([file_id], FileState.QUARANTINED, detail)

    def _hash_all(self, places: list[Place]) -> list[NewFile]:
        news = []
        for tier, entry in places:
            listed = listed_record(tier, entry)
            if listed is not None:
                news.append(listed)
                continue
            try:
                news.append(record_of(tier, entry.relpath))
                self.damage.clear(tier.name, entry.relpath)
            except IntegrityError as exc:
                self._damaged(tier, entry, exc)
            except (TierdError, OSError) as exc:
                # Vanished or became a symlink since we looked: the next pass decides.
                log.warning("could not adopt %r from tier %s: %s", entry.relpath, tier.name, exc)
        return news

    def _flush_places(self) -> None:
        news = self._hash_all(self._place)
        self._place.clear()
        if news:
            self.catalog.upsert_many(news)

    def _renamed(self, old: FileRecord, new: NewFile) -> None:
        self.report.renamed.append((old.relpath, new.relpath))
        log.info("%r in tier %s was renamed to %r", old.relpath, new.tier, new.relpath)

    def _match_renames(self) -> None:
        """Files renamed outside tierd keep their identity even when the events did not pair
        up (e.g. a move into a directory created a moment earlier, before its watch existed):
        a new file with the same tier, size and checksum as a vanished one *is* that file.

        The vanished record may be gone in this pass or already ``missing``; or, in the other
        order, the new bytes were adopted moments ago under a fresh record, which then gives way.
        """
        # Empty files all look alike: only files with bytes are matched.
        gone = {r.id: r for r in self._gone if r.checksum and r.size > 0}
        step = self.batch
        for batch in (self._adopt[i : i + step] for i in range(0, len(self._adopt), step)):
            fresh = []
            for new in self._hash_all(batch):
                if new.size == 0:
                    fresh.append(new)
                    continue
                twin = next(
                    (
                        r
                        for r in self.catalog.same_content(new.tier, new.size, new.checksum)
                        if self.ours(r) and (r.id in gone or r.state == FileState.MISSING)
                    ),
                    None,
                )
                if twin is not None and self.catalog.reassign(twin.id, new) is not None:
                    gone.pop(twin.id, None)
                    self._renamed(twin, new)
                else:
                    fresh.append(new)
            if fresh:
                self.catalog.upsert_many(fresh)
        self._adopt.clear()
        recent = time.time() - RENAME_WINDOW_S
        for rec in list(gone.values()):
            assert rec.checksum is not None
            successor = next(
                (
                    r
                    for r in self.catalog.same_content(rec.tier, rec.size, rec.checksum)
                    if r.id not in gone
                    and self.ours(r)
                    and r.state == FileState.STABLE
                    and r.created_at >= recent
                    and r.access_count == 0
                    and r.pinned_tier is None
                    and r.id not in self.busy
                ),
                None,
            )
            if successor is None or self.tiers[successor.tier].stat(successor.relpath) is None:
                continue
            new = NewFile(
                successor.relpath,
                successor.tier,
                successor.size,
                successor.mtime_ns,
                successor.checksum,
                successor.etag,
                successor.codec,
                successor.stored_size,
            )
            if self.catalog.reassign(rec.id, new) is not None:
                gone.pop(rec.id)
                self._renamed(rec, new)
        renamed_away = {o for o, _ in self.report.renamed}
        self._gone = [r for r in self._gone if r.relpath not in renamed_away]

    def _settle(self) -> None:
        """Match the held new and vanished files as renames, record the rest (new ones
        adopted, vanished ones ``missing``), and let go of them."""
        self._match_renames()
        if self._gone:
            ids = [r.id for r in self._gone]
            self.catalog.set_state(ids, FileState.MISSING, "not found on disk")
            self._gone.clear()

    def finish(self) -> ScanReport:
        if not self.check:
            self._flush_places()
            self._settle()
        else:
            self.report.adopted.sort()
        old_names = {o for o, _ in self.report.renamed}
        new_names = {n for _, n in self.report.renamed}
        self.report.missing = sorted(r for r in self.report.missing if r not in old_names)
        self.report.adopted = sorted(r for r in self.report.adopted if r not in new_names)
        self.report.finished_at = time.time()
        return self.report


def scan(
    catalog: Catalog,
    tiers: Iterable[Tier],
    *,
    check: bool = False,
    max_files_per_s: float | None = None,
    batch: int = BATCH,
    damage: DamageLog | None = None,
) -> ScanReport:
    """Walk every tier and bring the catalog in line with it (or, with ``check``, report).

    Only this host's records are reconciled (see the module's docstring). Files with an open
    migration belong to the mover and are left alone. ``max_files_per_s`` paces the pass so a
    background reconcile does not stall loads. The walks and the catalog are streamed and
    decisions applied ``batch`` files at a time (see the module's docstring).
    """
    tiers = list(tiers)
    report = ScanReport(check_only=check)
    reconcile = _Reconciler(catalog, tiers, report, check=check, batch=batch, damage=damage)
    pace = _Pacer(max_files_per_s)
    for relpath, places, rec in _merged(catalog, tiers, batch, report.failed):
        reconcile(relpath, places, rec)
        pace()
    report = reconcile.finish()
    if damage is not None and not check:
        damage.keep_only(reconcile.damaged)  # the rest is gone, or changed and read sound
    return report


def _merged(
    catalog: Catalog, tiers: Iterable[Tier], batch: int, failed: dict[str, str]
) -> Iterator[tuple[str, list[Place], FileRecord | None]]:
    """Every relpath on a tier or in the catalog, once and in order, with where it is and its
    record: the tiers' walks and the catalog's pages merged as they stream. A tier whose walk
    fails before its first entry (a bucket's listing: it is read whole first) is left out,
    named in ``failed`` with why."""
    streams = []
    for t in tiers:
        walk = _places(t)
        try:
            first = next(walk, None)
        except (TierdError, OSError) as exc:
            failed[t.name] = str(exc)
            log.warning(
                "tier %s could not be listed (its files are left as they are): %s", t.name, exc
            )
            continue
        if first is not None:
            streams.append(_in_order(f"tier {t.name}", itertools.chain((first,), walk)))
    streams.append(_in_order("the catalog", ((r.relpath, r) for r in catalog.by_relpath(batch))))
    for relpath, group in groupby(heapq.merge(*streams, key=itemgetter(0)), key=itemgetter(0)):
        places: list[Place] = []
        rec: FileRecord | None = None
        for _, item in group:
            if isinstance(item, FileRecord):
                rec = item
            else:
                places.append(item)
        yield relpath, places, rec


def _places(tier: Tier) -> Iterator[tuple[str, Place | FileRecord]]:
    for entry in tier.walk():
        yield entry.relpath, (tier, entry)


def _in_order(
    what: str, items: Iterator[tuple[str, Place | FileRecord]]
) -> Iterator[tuple[str, Place | FileRecord]]:
    """``items`` as they come, refusing one out of relpath order: the merge would take a file
    that is there for one that is gone."""
    last: str | None = None
    for item in items:
        if last is not None and item[0] <= last:
            raise TierdError(
                f"{what} listed {item[0]!r} after {last!r}, out of relpath order; scan stopped"
            )
        last = item[0]
        yield item


def reconcile_paths(
    catalog: Catalog,
    tiers: Iterable[Tier],
    relpaths: Iterable[str],
    *,
    check: bool = False,
    damage: DamageLog | None = None,
) -> ScanReport:
    """Reconcile just these relpaths (what the watcher calls for the paths events named)."""
    tiers = list(tiers)
    wanted = sorted(set(relpaths))
    records = catalog.find_many(wanted)
    report = ScanReport(check_only=check)
    reconcile = _Reconciler(catalog, tiers, report, check=check, damage=damage)
    for relpath in wanted:
        places: list[Place] = []
        for tier in tiers:
            try:
                st = tier.stat(relpath)
            except IntegrityError as exc:  # a container whose footer is damaged
                if not check:
                    reconcile._damaged(tier, WalkEntry(relpath, -1, 0), exc)
                else:
                    reconcile._skip(relpath, DAMAGED + exc.message)
                break
            if st is not None:
                # As the walk lists it: a container by its stored size (entry_version).
                size = st.stored_size if st.codec and st.stored_size is not None else st.size
                entry = WalkEntry(relpath, size, st.mtime_ns, etag=st.etag, codec=st.codec)
                places.append((tier, entry))
        else:
            reconcile(relpath, places, records.get(relpath))
    return reconcile.finish()
