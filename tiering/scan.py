"""Reconcile the catalog with what is on disk in the tier roots.

Adopts files placed in a tier from outside, notices files changed in place or moved by hand
between tiers, marks records whose bytes vanished as ``missing``, and reports a relpath present
in two tiers as a ``conflict``. It never deletes a user's file. With ``check=True`` it only
reports the drift.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

from tiering.catalog import Catalog, FileRecord, FileState, NewFile
from tiering.checksum import hash_fd
from tiering.errors import TierdError
from tiering.tiers import Tier, Tiers, WalkEntry

__all__ = ["ScanReport", "scan"]

log = logging.getLogger(__name__)


@dataclass
class ScanReport:
    adopted: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    conflicts: dict[str, list[str]] = field(default_factory=dict)
    unchanged: int = 0
    check_only: bool = False
    finished_at: float = 0.0

    @property
    def drift(self) -> int:
        return len(self.adopted) + len(self.changed) + len(self.moved) + len(self.missing)

    def summary(self) -> dict[str, object]:
        """Counts only: safe to show for a scan of millions of files."""
        return {
            "adopted": len(self.adopted),
            "changed": len(self.changed),
            "moved": len(self.moved),
            "missing": len(self.missing),
            "conflicts": len(self.conflicts),
            "unchanged": self.unchanged,
            "finished_at": self.finished_at,
        }

    def as_dict(self) -> dict[str, object]:
        return {
            "adopted": self.adopted,
            "changed": self.changed,
            "moved": self.moved,
            "missing": self.missing,
            "conflicts": self.conflicts,
            "unchanged": self.unchanged,
            "check_only": self.check_only,
            "finished_at": self.finished_at,
        }


def _hash(tier: Tier, relpath: str) -> tuple[str, os.stat_result]:
    fd, st = tier.open_read(relpath)
    try:
        return hash_fd(fd, st.st_size), st
    finally:
        os.close(fd)


def _place(catalog: Catalog, tier: Tier, entry: WalkEntry) -> None:
    checksum, st = _hash(tier, entry.relpath)
    catalog.upsert(NewFile(entry.relpath, tier.name, st.st_size, st.st_mtime_ns, checksum))


def scan(catalog: Catalog, tiers: Tiers, *, check: bool = False) -> ScanReport:
    """Walk every tier root and bring the catalog in line with it (or, with ``check``, report).

    Records in state ``migrating`` belong to the mover and are left alone.
    """
    report = ScanReport(check_only=check)
    on_disk: dict[str, list[tuple[Tier, WalkEntry]]] = defaultdict(list)
    for tier in tiers:
        for entry in tier.walk():
            on_disk[entry.relpath].append((tier, entry))
    records: dict[str, FileRecord] = {r.relpath: r for r in catalog.all()}

    for relpath, places in on_disk.items():
        rec = records.get(relpath)
        if rec is not None and rec.state == FileState.MIGRATING:
            continue
        if len(places) > 1:
            names = [t.name for t, _ in places]
            report.conflicts[relpath] = names
            log.warning("conflict: %r is present in tiers %s; nothing was deleted", relpath, names)
            if check:
                continue
            try:
                if rec is None:
                    # Adopt the copy on the fastest tier so the file is known; flag the rest.
                    _place(catalog, places[0][0], places[0][1])
                    rec = catalog.lookup(relpath)
                detail = "present in tiers " + ", ".join(names)
                if rec.state != FileState.CONFLICT or rec.detail != detail:
                    catalog.set_state([rec.id], FileState.CONFLICT, detail)
            except (TierdError, OSError) as exc:
                log.warning("could not record conflict for %r: %s", relpath, exc)
            continue
        tier, entry = places[0]
        if rec is None:
            report.adopted.append(relpath)
        elif rec.tier != tier.name:
            report.moved.append(relpath)
        elif rec.size != entry.size or rec.mtime_ns != entry.mtime_ns or rec.checksum is None:
            report.changed.append(relpath)
        elif rec.state != FileState.STABLE:
            report.changed.append(relpath)  # back from missing or conflict
        else:
            report.unchanged += 1
            continue
        if check:
            continue
        try:
            _place(catalog, tier, entry)
        except (TierdError, OSError) as exc:
            # Vanished or became a symlink between the walk and the open: next scan decides.
            log.warning("could not adopt %r from tier %s: %s", relpath, tier.name, exc)

    gone = [
        r
        for path, r in records.items()
        if path not in on_disk and r.state not in (FileState.MISSING, FileState.MIGRATING)
    ]
    report.missing = [r.relpath for r in gone]
    if gone and not check:
        catalog.set_state([r.id for r in gone], FileState.MISSING, "not found on disk")
    report.finished_at = time.time()
    return report
