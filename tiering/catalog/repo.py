"""The catalog repository: every query and write of file records goes through here."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import func, select, update

from tiering.catalog.db import Database
from tiering.catalog.models import FileRecord, FileState
from tiering.errors import FileNotFound

__all__ = ["Catalog", "NewFile", "TierUsage"]


@dataclass(frozen=True)
class NewFile:
    """What the catalog needs to know about bytes just placed on a tier."""

    relpath: str
    tier: str
    size: int
    mtime_ns: int
    checksum: str | None


@dataclass(frozen=True)
class TierUsage:
    files: int
    bytes: int


def _escape_like(prefix: str) -> str:
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


class Catalog:
    """File records over one :class:`Database`.

    Reads may run on any thread; writes are serialised by the database's single writer.
    Returned records are detached snapshots: changing them changes nothing.
    """

    def __init__(self, db: Database) -> None:
        self.db = db

    # -- reads -------------------------------------------------------------------------------
    def get(self, file_id: int) -> FileRecord:
        with self.db.read() as s:
            rec = s.get(FileRecord, file_id)
        if rec is None:
            raise FileNotFound(f"no file with id {file_id}", file_id=file_id)
        return rec

    def lookup(self, relpath: str) -> FileRecord:
        with self.db.read() as s:
            rec = s.scalar(select(FileRecord).where(FileRecord.relpath == relpath))
        if rec is None:
            raise FileNotFound(f"no file at path {relpath!r}", path=relpath)
        return rec

    def find(self, relpath: str) -> FileRecord | None:
        with self.db.read() as s:
            return s.scalar(select(FileRecord).where(FileRecord.relpath == relpath))

    def page(
        self,
        *,
        tier: str | None = None,
        prefix: str | None = None,
        states: Sequence[str] | None = None,
        after_id: int = 0,
        limit: int = 100,
    ) -> list[FileRecord]:
        """Records ordered by id, starting after ``after_id`` (keyset pagination)."""
        q = select(FileRecord).where(FileRecord.id > after_id)
        if tier is not None:
            q = q.where(FileRecord.tier == tier)
        if prefix:
            q = q.where(FileRecord.relpath.like(_escape_like(prefix) + "%", escape="\\"))
        if states is not None:
            q = q.where(FileRecord.state.in_(list(states)))
        q = q.order_by(FileRecord.id).limit(limit)
        with self.db.read() as s:
            return list(s.scalars(q))

    def all(self) -> list[FileRecord]:
        with self.db.read() as s:
            return list(s.scalars(select(FileRecord).order_by(FileRecord.id)))

    def usage(self) -> dict[str, TierUsage]:
        """Files and bytes per tier, by the catalog (missing files are not counted)."""
        q = (
            select(FileRecord.tier, func.count(), func.coalesce(func.sum(FileRecord.size), 0))
            .where(FileRecord.state != FileState.MISSING)
            .group_by(FileRecord.tier)
        )
        with self.db.read() as s:
            return {t: TierUsage(int(n), int(b)) for t, n, b in s.execute(q)}

    def count(self) -> int:
        with self.db.read() as s:
            return int(s.scalar(select(func.count()).select_from(FileRecord)) or 0)

    # -- writes ------------------------------------------------------------------------------
    def upsert(self, new: NewFile, *, now: float | None = None) -> FileRecord:
        """Record bytes just published at ``new.relpath``: insert, or replace the content of
        the existing record (keeping its identity, heat and pin) and bump its generation."""
        now = time.time() if now is None else now
        with self.db.write() as s:
            rec = s.scalar(select(FileRecord).where(FileRecord.relpath == new.relpath))
            if rec is None:
                rec = FileRecord(
                    relpath=new.relpath,
                    generation=0,
                    access_count=0,
                    heat=0.0,
                    heat_at=now,
                    created_at=now,
                )
                s.add(rec)
            else:
                rec.generation += 1
            rec.tier = new.tier
            rec.size = new.size
            rec.mtime_ns = new.mtime_ns
            rec.checksum = new.checksum
            rec.state = FileState.STABLE
            rec.detail = None
            rec.updated_at = now
            s.flush()
            return rec

    def set_state(self, file_ids: Iterable[int], state: str, detail: str | None = None) -> int:
        ids = list(file_ids)
        if not ids:
            return 0
        with self.db.write() as s:
            res = s.execute(
                update(FileRecord)
                .where(FileRecord.id.in_(ids))
                .values(state=state, detail=detail, updated_at=time.time())
            )
            return int(res.rowcount or 0)  # type: ignore[attr-defined]

    def delete(
        self,
        file_id: int,
        *,
        generation: int | None = None,
        before_commit: Callable[[FileRecord], object] | None = None,
    ) -> bool:
        """Remove a record; with ``generation``, only if it is still at that generation.

        ``before_commit`` runs inside the write transaction, after the write lock is held: if it
        raises, the record stays. Deleting a file's bytes there means a busy catalog can never
        leave bytes deleted under a live record.
        """
        with self.db.write() as s:
            rec = s.get(FileRecord, file_id)
            if rec is None or (generation is not None and rec.generation != generation):
                return False
            s.delete(rec)
            s.flush()
            if before_commit is not None:
                before_commit(rec)
            return True

    def record_accesses(self, counts: Mapping[int, int], *, now: float, half_life_s: float) -> None:
        """Add accesses in one batch: decay each file's heat to ``now``, then add the count."""
        if not counts:
            return
        params = [{"fid": fid, "n": n, "now": now, "hl": half_life_s} for fid, n in counts.items()]
        with self.db.write() as s:
            s.connection().exec_driver_sql(
                "UPDATE files SET heat = tierd_decay(heat, heat_at, :now, :hl) + :n, "
                "heat_at = :now, access_count = access_count + :n, last_access = :now "
                "WHERE id = :fid",
                params,
            )
