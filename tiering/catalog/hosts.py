"""The catalog's table of hosts (see :class:`~tiering.catalog.models.HostRow`): registration
at start and the heartbeat, and what every host reads of the others."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from tiering.catalog.db import Database
from tiering.catalog.models import FileRecord, FileState, HostRow

__all__ = ["HostInfo", "Hosts", "PlaceUsage"]


@dataclass(frozen=True)
class HostInfo:
    host_id: str
    address: str
    started_at: float
    last_heartbeat: float
    version: str
    report: str  # JSON, as the host wrote it


@dataclass(frozen=True)
class PlaceUsage:
    """Files and bytes the catalog records on one tier of one host (``host`` None: a shared
    tier, or rows no host has been attributed)."""

    host: str | None
    tier: str
    files: int
    bytes: int


def _info(r: HostRow) -> HostInfo:
    return HostInfo(r.host_id, r.address, r.started_at, r.last_heartbeat, r.version, r.report)


class Hosts:
    """Rows of hosts over one :class:`Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def register(
        self, host_id: str, *, address: str, version: str, report: str, now: float | None = None
    ) -> None:
        """Insert or replace this host's row at start (a restart is a new ``started_at``)."""
        now = time.time() if now is None else now

        def body(s: Session) -> None:
            row = s.get(HostRow, host_id)
            if row is None:
                row = HostRow(host_id=host_id)
                s.add(row)
            row.address = address
            row.version = version
            row.report = report
            row.started_at = now
            row.last_heartbeat = now

        # Two processes registering one host id at once: the second replaces the first's row
        # (the catalog lock has already refused one of them to serve).
        self.db.transact(body, changes_files=False, retry_unique=True)

    def heartbeat(self, host_id: str, *, report: str, now: float | None = None) -> bool:
        """Stamp this host's heartbeat and rewrite its report; False when its row is gone."""
        now = time.time() if now is None else now
        q = (
            update(HostRow)
            .where(HostRow.host_id == host_id)
            .values(last_heartbeat=now, report=report)
        )
        return self.db.transact(
            lambda s: bool(s.execute(q).rowcount),  # type: ignore[attr-defined]
            changes_files=False,
        )

    def get(self, host_id: str) -> HostInfo | None:
        with self.db.read() as s:
            row = s.get(HostRow, host_id)
            return None if row is None else _info(row)

    def all(self) -> list[HostInfo]:
        with self.db.read() as s:
            return [_info(r) for r in s.scalars(select(HostRow).order_by(HostRow.host_id))]

    def usage(self) -> list[PlaceUsage]:
        """Files and bytes per (host, tier) by the catalog; missing files are not counted."""
        q = (
            select(
                FileRecord.host,
                FileRecord.tier,
                func.count(),
                func.coalesce(func.sum(FileRecord.size), 0),
            )
            .where(FileRecord.state != FileState.MISSING)
            .group_by(FileRecord.host, FileRecord.tier)
        )
        with self.db.read() as s:
            return [PlaceUsage(h, t, int(n), int(b)) for h, t, n, b in s.execute(q)]

    def adopt_files(self, host_id: str, tiers: list[str]) -> int:
        """Attribute to ``host_id`` every row on ``tiers`` (its host-local ones) that names no
        host or another one: rows written before hosts were recorded, and rows of this same
        machine under an earlier host id (a recreated container's new hostname). Only right
        where one host ever writes the catalog (SQLite), which is where the engine calls it."""
        if not tiers:
            return 0
        other = or_(FileRecord.host.is_(None), FileRecord.host != host_id)
        q = update(FileRecord).where(and_(other, FileRecord.tier.in_(tiers))).values(host=host_id)
        return self.db.transact(lambda s: int(s.execute(q).rowcount or 0))  # type: ignore[attr-defined]
