"""Units of placement: what the planner moves together.

A unit is one file, or every file of a model: a directory that directly holds safetensors
weights (see :mod:`tiering.io.hfmodel`), with its index, config and tokenizer files beside
them. A model moves as a unit so that the policy never leaves part of it on a slow tier: a
load of a model waits for its slowest shard, so a model split over two tiers loads at the
speed of the slower one while taking room on the faster.

A model's heat is the heat of its **hottest weights file** (the maximum, not the sum):

- loading a model reads every shard once, so each shard gains one access per load, and the
  maximum is "loads of this model per half-life", the same unit as a single file's heat, so
  the policy's thresholds mean the same for a 1-file and a 30-shard model; a sum would count
  a 30-shard model loaded once as 30 accesses and promote it before a single-file model
  loaded ten times;
- a partial load (one rank of a tensor-parallel group reads a few shards) still counts,
  through the shards it reads;
- reads of the config or tokenizer files (small, read by tools that never touch the weights)
  do not move gigabytes of weights.

Files in state ``missing`` are no part of any unit (their bytes are gone; they cannot move,
and must not hold the rest of their model back). Pins: a pin on any file of a model pins the
whole model there (``POST /v1/models/{name}/pin`` pins every file alike); files of one model
pinned to *different* tiers are planned as single files, each to its pin, since the pins ask
for exactly that split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from tiering.io.hfmodel import is_weights, model_name
from tiering.placement.policy import FileView

__all__ = ["Member", "Unit", "build_units"]


@dataclass
class Member:
    """One file of a unit: where it is (``home``) and where the plan puts it (``place``),
    as tier ranks."""

    rec: FileView
    id: int
    relpath: str
    size: int
    home: int
    place: int


@dataclass
class Unit:
    """What moves as one: a single file (``model`` None) or a model's files.

    ``home`` is the rank holding most of its bytes (a model may be split across tiers when
    the planner first sees it); ``place`` is where the plan puts it whole. Every member is at
    ``place`` once the unit has moved, so a unit is split only while it has not.
    """

    members: list[Member]
    model: str | None
    heat: float
    pinned: str | None
    eligible: bool  # every member stable and old enough for policy moves
    movable: bool  # every member stable (pins ignore the minimum age)
    home: int
    place: int
    kind: str = ""
    reason: str = ""

    @property
    def id(self) -> int:
        return self.members[0].id

    @property
    def size(self) -> int:
        return sum(m.size for m in self.members)

    @property
    def split(self) -> bool:
        return any(m.place != self.place for m in self.members)

    def cost(self, to: int) -> int:
        """Bytes that putting the whole unit on rank ``to`` adds there."""
        return sum(m.size for m in self.members if m.place != to)

    def describe(self) -> str:
        """How messages name a model unit."""
        return f"model {self.model} ({len(self.members)} files, {self.size} bytes)"


def _home(members: list[Member]) -> int:
    """The rank holding most of the members' bytes (then most files; then the faster)."""
    totals: dict[int, tuple[int, int]] = {}
    for m in members:
        b, n = totals.get(m.home, (0, 0))
        totals[m.home] = (b + m.size, n + 1)
    return min(totals, key=lambda r: (-totals[r][0], -totals[r][1], r))


def build_units(
    files: Iterable[FileView],
    rank: Mapping[str, int],
    heat: Callable[[FileView], float],
    *,
    min_age_s: float,
    now: float,
) -> list[Unit]:
    """Group ``files`` (each on a tier in ``rank``) into units, in order of their first file.

    ``heat(rec)`` is a file's heat now.
    """
    recs = list(files)
    models = {
        name for r in recs if r.state != "missing" and (name := model_name(r.relpath)) is not None
    }
    groups: dict[str | int, list[FileView]] = {}
    for r in recs:
        directory = r.relpath.rpartition("/")[0]
        key: str | int = directory if r.state != "missing" and directory in models else -r.id
        groups.setdefault(key, []).append(r)
    units: list[Unit] = []
    for key, group in groups.items():
        pins = {r.pinned_tier for r in group if r.pinned_tier in rank}
        if isinstance(key, str) and len(pins) <= 1:
            units.append(_unit(group, key, rank, heat, min_age_s, now))
        else:
            units.extend(_unit([r], None, rank, heat, min_age_s, now) for r in group)
    return units


def _unit(
    group: list[FileView],
    model: str | None,
    rank: Mapping[str, int],
    heat: Callable[[FileView], float],
    min_age_s: float,
    now: float,
) -> Unit:
    members = [
        Member(r, r.id, r.relpath, int(r.size), rank[r.tier], rank[r.tier])
        for r in sorted(group, key=lambda r: r.id)
    ]
    stable = all(r.state == "stable" for r in group)
    if model is None:
        hottest = heat(group[0])
    else:
        weights = [r for r in group if is_weights(r.relpath.rpartition("/")[2])]
        hottest = max(heat(r) for r in weights or group)
    pinned = next((r.pinned_tier for r in group if r.pinned_tier in rank), None)
    home = _home(members)
    return Unit(
        members,
        model,
        hottest,
        pinned,
        stable and all(now - r.updated_at >= min_age_s for r in group),
        stable,
        home,
        home,
    )
