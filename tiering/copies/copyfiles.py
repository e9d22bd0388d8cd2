"""The files of :mod:`tiering.copies.hostcopies`: names, the temp a fill writes, the sweep
of a copies directory at reconcile, and the source a copy is read through."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tiering.catalog.copies import CopyRow
from tiering.checksum import Hasher
from tiering.placement.cache import CachePlan
from tiering.placement.fleetheat import LocalHeat, heat_for_promotion
from tiering.placement.policy import FileView, Policy
from tiering.tiers import FillCancelled, Source, Stat, Tier
from tiering.tiers.paths import is_temp_name

__all__ = [
    "CHUNK",
    "CopyEntry",
    "CopyPassReport",
    "CopySource",
    "LocalCopy",
    "ReconcileReport",
    "copy_heat",
    "copy_name",
    "fsync_dir",
    "parse_name",
    "sweep",
    "unlink",
    "write_temp",
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
class LocalCopy:
    """A copy opened for reading: ``fd`` (the caller closes it) and its ``path``."""

    tier: Tier
    path: Path
    fd: int


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


class CopySource(Source):
    """A copy's bytes read through its fd; the file record it caches is ``relpath``'s."""

    def __init__(self, relpath: str, fd: int) -> None:
        self.relpath = relpath
        self.fd = fd
        st = os.fstat(fd)
        self.stat = Stat(st.st_size, st.st_mtime_ns, f"{st.st_dev}:{st.st_ino}")

    def readinto(self, buf: memoryview, offset: int) -> int:
        total = 0
        while total < len(buf):
            n = os.preadv(self.fd, [buf[total:]], offset + total)
            if n == 0:
                break
            total += n
        return total

    def unchanged(self) -> bool:
        return self.fd >= 0  # never renamed over or rewritten: a new generation is a new name

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def write_temp(
    src: Source,
    temp: Path,
    *,
    stop: Callable[[], bool],
    throttle: Callable[[int], None] | None,
    progress: Callable[[int], None] | None,
) -> tuple[int, str]:
    """Write ``src``'s bytes to the new file ``temp``, hashed on the way, and fsync it;
    returns (bytes, checksum). Raises :class:`FillCancelled` when ``stop()`` turns true."""
    h = Hasher()
    n = 0
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        for chunk in src.chunks(CHUNK):
            if stop():
                raise FillCancelled
            if throttle is not None:
                throttle(len(chunk))
            _write_all(fd, chunk)
            h.update(chunk)
            n += len(chunk)
            if progress is not None:
                progress(len(chunk))
        os.fsync(fd)
    finally:
        os.close(fd)
    return n, h.value()


def sweep(
    d: Path, tier: str, rows: Mapping[tuple[int, str], CopyRow], report: ReconcileReport
) -> set[tuple[int, str]]:
    """Remove from copies directory ``d`` (of ``tier``) every temp and every file that is not
    the copy a row names (its generation and size); returns the (file id, tier) of those kept."""
    found: set[tuple[int, str]] = set()
    if not d.is_dir():
        return found
    removed = False
    with os.scandir(d) as it:
        for entry in it:
            parsed = parse_name(entry.name)
            row = rows.get((parsed[0], tier)) if parsed else None
            if is_temp_name(entry.name):
                report.temps += 1
            elif (
                parsed is not None
                and row is not None
                and row.generation == parsed[1]
                and entry.is_file(follow_symlinks=False)
                and entry.stat(follow_symlinks=False).st_size == row.size
            ):
                found.add((parsed[0], tier))
                continue
            else:
                report.files += 1
            unlink(d / entry.name)
            removed = True
    if removed:
        fsync_dir(d)
    return found


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
