"""The fleet as the shared catalog records it: every host with its liveness, tiers and GPUs
(:func:`fleet_hosts`), and every host that holds a file, warmest first (:func:`locate`).

What each host's tiers are comes from its own heartbeat report; where a file is comes from
the file's record (its tier, and the host whose own tier that is when it is host-local) and
from the copies table (cached copies in a host's memory tier, or on one of its directory
tiers: a copy of a shared file, see :mod:`tiering.copies.hostcopies`). A file on a shared
tier (an object store) is held by every host that has that tier, as its coldest place. During
a distribution, each host's verified pieces of the current generation (the piece holdings,
see :mod:`tiering.catalog.pieces`) show how far it is.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, select

from tiering.catalog import Copies, FileRecord, FileState
from tiering.catalog.hosts import HostInfo, Hosts
from tiering.catalog.models import Copy, PieceHolding, PieceMap

__all__ = [
    "FleetHost",
    "FleetTier",
    "HostPieces",
    "HostPlace",
    "Located",
    "fleet_hosts",
    "locate",
]

UP, DOWN = "up", "down"


@dataclass(frozen=True)
class FleetTier:
    name: str
    kind: str
    rank: int
    shared: bool
    files: int
    bytes: int


@dataclass(frozen=True)
class FleetHost:
    host_id: str
    address: str
    state: str  # up or down, by the heartbeat's age
    started_at: float
    last_heartbeat: float
    version: str
    tiers: list[FleetTier]
    gpus: list[dict[str, Any]]


@dataclass(frozen=True)
class HostPlace:
    """Where one host has a file: ``memory`` (a cached copy in its memory tier, ``location``
    naming it), ``tier`` (its own tier ``location`` of rank ``rank``), ``copy`` (a cached copy
    of a shared file on its own directory tier ``location`` of rank ``rank``) or
    ``object_store`` (a shared tier it reads)."""

    host_id: str
    address: str
    state: str
    kind: str
    location: str
    rank: int | None

    def warmth(self) -> tuple[int, int]:
        """Sort key, warmest first: memory, then its own tiers by rank, then object stores."""
        order = {"memory": 0, "tier": 1, "copy": 1, "object_store": 2}[self.kind]
        return order, self.rank if self.rank is not None else -1


@dataclass(frozen=True)
class HostPieces:
    """How many of the ``total`` pieces of a file's current generation one host has verified
    (its piece holding: whole once ``pieces == total``, partial while a fill runs)."""

    host_id: str
    address: str
    state: str
    pieces: int
    total: int


@dataclass(frozen=True)
class Located:
    """Every place of one file, warmest first (up hosts before down ones at equal warmth), and
    every host's verified pieces of its current generation, most first."""

    record: FileRecord
    places: list[HostPlace] = field(default_factory=list)
    pieces: list[HostPieces] = field(default_factory=list)


def _report(h: HostInfo) -> dict[str, Any]:
    try:
        doc = json.loads(h.report)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _state(h: HostInfo, now: float, timeout_s: float) -> str:
    return UP if now - h.last_heartbeat <= timeout_s else DOWN


def fleet_hosts(hosts: Hosts, *, timeout_s: float, now: float | None = None) -> list[FleetHost]:
    """Every registered host, by id. A host-local tier's use is what the catalog records on
    that host's tier; a shared tier's is the fleet's (the same for every host that has it)."""
    now = time.time() if now is None else now
    use = {(u.host, u.tier): u for u in hosts.usage()}
    out: list[FleetHost] = []
    for h in hosts.all():
        doc = _report(h)
        tiers: list[FleetTier] = []
        for t in doc.get("tiers", []):
            shared = bool(t.get("shared"))
            u = use.get((None if shared else h.host_id, str(t.get("name"))))
            tiers.append(
                FleetTier(
                    name=str(t.get("name")),
                    kind=str(t.get("kind")),
                    rank=int(t.get("rank", 0)),
                    shared=shared,
                    files=u.files if u else 0,
                    bytes=u.bytes if u else 0,
                )
            )
        out.append(
            FleetHost(
                host_id=h.host_id,
                address=h.address,
                state=_state(h, now, timeout_s),
                started_at=h.started_at,
                last_heartbeat=h.last_heartbeat,
                version=h.version,
                tiers=tiers,
                gpus=[g for g in doc.get("gpus", []) if isinstance(g, dict)],
            )
        )
    return out


def _copies_of(copies: Copies, file_ids: Sequence[int]) -> dict[int, list[Copy]]:
    """The copies of these files, by file, in a query per 500 files (not one per file: a
    model has hundreds)."""
    out: dict[int, list[Copy]] = {}
    with copies.db.read() as s:
        for i in range(0, len(file_ids), 500):
            q = select(Copy).where(Copy.file_id.in_(file_ids[i : i + 500])).order_by(Copy.id)
            for c in s.scalars(q):
                out.setdefault(c.file_id, []).append(c)
    return out


def _pieces_of(
    copies: Copies, file_ids: Sequence[int]
) -> dict[int, list[tuple[PieceHolding, int]]]:
    """Every host's piece holding of these files with its generation's piece count, by file
    (a query per 500 files)."""
    out: dict[int, list[tuple[PieceHolding, int]]] = {}
    with copies.db.read() as s:
        for i in range(0, len(file_ids), 500):
            q = (
                select(PieceHolding, PieceMap.size, PieceMap.piece_size)
                .join(
                    PieceMap,
                    and_(
                        PieceMap.file_id == PieceHolding.file_id,
                        PieceMap.generation == PieceHolding.generation,
                    ),
                )
                .where(PieceHolding.file_id.in_(file_ids[i : i + 500]))
                .order_by(PieceHolding.pieces.desc(), PieceHolding.host)
            )
            for h, size, piece_size in s.execute(q):
                total = max(1, -(-int(size) // int(piece_size)))
                out.setdefault(h.file_id, []).append((h, total))
    return out


def locate(
    hosts: Hosts,
    copies: Copies,
    records: Sequence[FileRecord],
    *,
    timeout_s: float,
    now: float | None = None,
) -> list[Located]:
    """Every host's places of each of ``records``, warmest first.

    A copy of another generation than the record's is stale and not counted; a host that has
    a copy is listed once per place (a memory copy and its own tier are both shown). A record
    marked missing has no place on its tier. Piece holdings of the current generation are
    listed apart (``pieces``): a host with some pieces of a file has no place of it yet. Reads
    only: a query for the hosts and two per 500 records (copies, piece holdings).
    """
    now = time.time() if now is None else now
    infos = {h.host_id: h for h in hosts.all()}
    held = _copies_of(copies, [r.id for r in records])
    pieces = _pieces_of(copies, [r.id for r in records])
    ranks: dict[str, dict[str, tuple[int, bool]]] = {}
    for hid, h in infos.items():
        ranks[hid] = {
            str(t.get("name")): (int(t.get("rank", 0)), bool(t.get("shared")))
            for t in _report(h).get("tiers", [])
        }
    out: list[Located] = []
    for rec in records:
        places: list[HostPlace] = []

        def add(hid: str, kind: str, location: str, rank: int | None) -> HostPlace:
            h = infos.get(hid)
            address, state = ("", DOWN) if h is None else (h.address, _state(h, now, timeout_s))
            return HostPlace(hid, address, state, kind, location, rank)

        for c in held.get(rec.id, []):
            if c.generation == rec.generation:
                # A copy at one of the host's tiers is on its disk; elsewhere, in its memory.
                on_disk = ranks.get(c.host, {}).get(c.location)
                if on_disk is not None:
                    places.append(add(c.host, "copy", c.location, on_disk[0]))
                else:
                    places.append(add(c.host, "memory", c.location, None))
        if rec.state == FileState.MISSING:
            pass  # its bytes are not on its tier: only copies taken before they vanished
        elif rec.host is not None:
            rank = ranks.get(rec.host, {}).get(rec.tier)
            places.append(add(rec.host, "tier", rec.tier, rank[0] if rank else None))
        else:
            for hid, tiers in ranks.items():
                rank_shared = tiers.get(rec.tier)
                if rank_shared is not None and rank_shared[1]:
                    places.append(add(hid, "object_store", rec.tier, rank_shared[0]))
        places.sort(key=lambda p: (p.warmth(), p.state != UP, p.host_id))
        counts = []
        for holding, total in pieces.get(rec.id, []):
            if holding.generation == rec.generation:  # an old generation's serve no one
                info = infos.get(holding.host)
                address, state = (
                    ("", DOWN) if info is None else (info.address, _state(info, now, timeout_s))
                )
                counts.append(HostPieces(holding.host, address, state, holding.pieces, total))
        out.append(Located(rec, places, counts))
    return out
