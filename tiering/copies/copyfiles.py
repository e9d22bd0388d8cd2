"""The files of :mod:`tiering.copies.hostcopies`: names, the copy a fill writes, and the
sweep of a tier's copies at reconcile. Every byte goes through the copies area's own tier
primitives (:meth:`~tiering.tiers.Tier.copies`): its writer keeps the crash-safe publish,
its sources the reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tiering.catalog.copies import CopyRow
from tiering.errors import FileChanged
from tiering.placement.cache import CachePlan
from tiering.placement.fleetheat import LocalHeat, heat_for_promotion
from tiering.placement.policy import FileView, Policy
from tiering.tiers import FillCancelled, Published, Source, Tier

__all__ = [
    "CHUNK",
    "CopyEntry",
    "CopyPassReport",
    "ReconcileReport",
    "copy_heat",
    "copy_name",
    "parse_name",
    "sweep",
    "write_copy",
]

CHUNK = 8 << 20


def copy_heat(rec: FileView, policy: Policy, now: float, local: LocalHeat | None) -> float:
    """The heat the copy planner ranks a shared file by, decayed to ``now``: this host's own
    or the fleet's, as the policy's ``promotion_heat`` says (see
    :func:`~tiering.placement.fleetheat.heat_for_promotion`; ``local`` is read once a pass)."""
    return heat_for_promotion(policy, rec, now, local)


def copy_name(file_id: int, generation: int) -> str:
    return f"{file_id}.{generation}"


def parse_name(name: str) -> tuple[int, int] | None:
    fid, dot, gen = name.partition(".")
    if not dot or not fid.isdigit() or not gen.isdigit():
        return None
    return int(fid), int(gen)


@dataclass
class CopyEntry:
    """A complete, recorded copy on tier ``tier``."""

    file_id: int
    generation: int
    size: int
    tier: str
    keep_until: float = 0.0


@dataclass
class ReconcileReport:
    temps: int = 0
    files: int = 0  # copy files without a current row, removed
    rows: int = 0  # rows without a file of their generation, removed
    kept: int = 0


@dataclass
class CopyPassReport:
    started_at: float
    plans: dict[str, CachePlan] = field(default_factory=dict)
    filled: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)


def write_copy(
    src: Source,
    area: Tier,
    name: str,
    *,
    size: int,
    checksum: str | None,
    stop: Callable[[], bool],
    throttle: Callable[[int], None] | None,
    progress: Callable[[int], None] | None,
) -> Published:
    """Write ``src``'s bytes as the copy ``name`` in copies area ``area`` through its writer
    (a temp, hashed on the way, fsynced, then published over any file of that name, and the
    directory fsynced). Bytes of another ``size`` are refused with
    :class:`~tiering.errors.FileChanged`, and with ``checksum`` others with
    :class:`~tiering.errors.IntegrityError`: nothing is published then. Raises
    :class:`FillCancelled` when ``stop()`` turns true."""
    with area.writer(name, overwrite=True, checksum=checksum) as w:
        for chunk in src.chunks(CHUNK):
            if stop():
                raise FillCancelled
            if throttle is not None:
                throttle(len(chunk))
            w.write(chunk)
            if progress is not None:
                progress(len(chunk))
        if w.size != size:
            raise FileChanged(f"{src.relpath!r} is {w.size} bytes, the catalog says {size}")
        return w.publish()


def sweep(
    area: Tier, tier: str, rows: Mapping[tuple[int, str], CopyRow], report: ReconcileReport
) -> set[tuple[int, str]]:
    """Remove from copies area ``area`` (of ``tier``) every temp and every file that is not
    the copy a row names (its generation and size); returns the (file id, tier) of those kept."""
    for relpath, stem in list(area.temps()):
        if area.remove_temp(relpath, stem):
            report.temps += 1
    found: set[tuple[int, str]] = set()
    for entry in list(area.walk()):
        parsed = parse_name(entry.relpath)
        row = rows.get((parsed[0], tier)) if parsed else None
        if (
            parsed is not None
            and row is not None
            and (row.generation, row.size)
            == (
                parsed[1],
                entry.size,
            )
        ):
            found.add((parsed[0], tier))
        elif area.remove(entry.relpath):
            report.files += 1
    return found
