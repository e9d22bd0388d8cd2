"""The catalog repository: every query and write of file records goes through here."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select, update

from tiering.catalog.db import Database
from tiering.catalog.models import FileRecord, FileState, owned_file_ids
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
    etag: str | None = None


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
        self._cache: dict[int, tuple[FileRecord, tuple[int, int]]] = {}
        self._paths: dict[str, tuple[int, int]] = {}  # relpath -> (file id, generation)

    # -- reads -------------------------------------------------------------------------------
    def get(self, file_id: int, *, cached: bool = False) -> FileRecord:
        """One record. ``cached`` may answer from memory, for the read path: the record's place,
        state and content are current, its access counters may lag the last flush."""
        rec = self._cache_get(file_id) if cached else None
        if rec is None:
            stamp = self.db.stamp(file_id)
            with self.db.read() as s:
                rec = s.get(FileRecord, file_id)
            if rec is not None:
                self._cache_put(file_id, rec, stamp)
        if rec is None:
            raise FileNotFound(f"no file with id {file_id}", file_id=file_id)
        return rec

    def lookup(self, relpath: str, *, cached: bool = False) -> FileRecord:
        """One record by relpath; ``cached`` as for :meth:`get`."""
        if cached:
            # Which record a relpath names changes only with writes that bump the global
            # generation; the record itself comes from the per-file cache.
            hit = self._paths.get(relpath)
            if hit is not None and hit[1] == self.db.generation:
                with contextlib.suppress(FileNotFound):
                    rec = self.get(hit[0], cached=True)
                    if rec.relpath == relpath:
                        return rec
        generation = self.db.generation
        with self.db.read() as s:
            found = s.scalar(select(FileRecord).where(FileRecord.relpath == relpath))
        if found is None:
            raise FileNotFound(f"no file at path {relpath!r}", path=relpath)
        if cached and generation % 2 == 0:
            self._trim(self._paths)
            self._paths[relpath] = (found.id, generation)
        return found

    # A 4 KiB load spends more time reading its record from SQLite than reading its bytes; the
    # read path keeps records here, each valid while no write that may change it has committed
    # since it was read: any write that changes files without naming them, or one naming it
    # (Database.stamp). A move names its file, so it leaves every other record cached.
    _CACHE_MAX = 65_536

    def _cache_get(self, file_id: int) -> FileRecord | None:
        hit = self._cache.get(file_id)
        if hit is None or hit[1] != self.db.stamp(file_id):
            return None
        return hit[0]

    def _cache_put(self, file_id: int, rec: FileRecord, stamp: tuple[int, int]) -> None:
        if stamp[0] % 2 or stamp[1] % 2:  # read while a write was in progress: don't keep it
            return
        self._trim(self._cache)
        self._cache[file_id] = (rec, stamp)

    def _trim(self, cache: dict[Any, Any]) -> None:
        if len(cache) >= self._CACHE_MAX:
            cache.clear()

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

    def busy_file_ids(self) -> set[int]:
        """Files with an open migration intent: the mover owns them until it closes."""
        with self.db.read() as s:
            return {fid for fid in s.scalars(owned_file_ids()) if fid is not None}

    def count(self) -> int:
        with self.db.read() as s:
            return int(s.scalar(select(func.count()).select_from(FileRecord)) or 0)

    # -- writes ------------------------------------------------------------------------------
    def upsert(self, new: NewFile, *, now: float | None = None) -> FileRecord | None:
        """Record bytes just published at ``new.relpath``; see :meth:`upsert_many`."""
        return self.upsert_many([new], now=now)[0]

    def upsert_many(
        self, news: Sequence[NewFile], *, now: float | None = None
    ) -> list[FileRecord | None]:
        """Record bytes just published, in one transaction: insert each, or replace the content
        of the existing record (keeping its id, heat and pin) and bump its generation.

        A record owned by a migration is left alone, and its slot in the result is None.
        """
        now = time.time() if now is None else now
        out: list[FileRecord | None] = []
        with self.db.write() as s:
            existing = {
                r.relpath: r
                for r in s.scalars(
                    select(FileRecord).where(FileRecord.relpath.in_([n.relpath for n in news]))
                )
            }
            for new in news:
                rec = existing.get(new.relpath)
                if rec is not None and rec.state == FileState.MIGRATING:
                    out.append(None)
                    continue
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
                    existing[new.relpath] = rec
                else:
                    rec.generation += 1
                rec.tier = new.tier
                rec.size = new.size
                rec.mtime_ns = new.mtime_ns
                rec.checksum = new.checksum
                rec.etag = new.etag
                rec.state = FileState.STABLE
                rec.detail = None
                rec.updated_at = now
                out.append(rec)
            s.flush()
        return out

    def find_many(self, relpaths: Sequence[str]) -> dict[str, FileRecord]:
        out: dict[str, FileRecord] = {}
        with self.db.read() as s:
            for i in range(0, len(relpaths), 500):
                chunk = list(relpaths[i : i + 500])
                q = select(FileRecord).where(FileRecord.relpath.in_(chunk))
                out.update((r.relpath, r) for r in s.scalars(q))
        return out

    def rename(self, old_relpath: str, new_relpath: str, tier: str) -> FileRecord | None:
        """A file renamed within ``tier`` outside tierd: move the record to the new relpath,
        keeping its id, heat and pin (see :meth:`reassign`). Returns the renamed record, or None
        when there was none to rename (or it is owned by a migration)."""
        rec = self.find(old_relpath)
        if rec is None or rec.tier != tier:
            return None
        return self.reassign(
            rec.id, NewFile(new_relpath, rec.tier, rec.size, rec.mtime_ns, rec.checksum, rec.etag)
        )

    def same_content(self, tier: str, size: int, checksum: str | None) -> list[FileRecord]:
        """Records on ``tier`` with exactly this size and checksum (rename detection)."""
        if checksum is None:
            return []
        q = select(FileRecord).where(
            FileRecord.checksum == checksum, FileRecord.size == size, FileRecord.tier == tier
        )
        with self.db.read() as s:
            return list(s.scalars(q.order_by(FileRecord.id)))

    def reassign(self, keep_id: int, new: NewFile) -> FileRecord | None:
        """Give record ``keep_id`` the bytes now at ``new.relpath`` (the file was renamed there),
        keeping its id, heat and pin. A record already at that relpath is dropped: it named the
        same bytes moments ago, or bytes the rename replaced. None when ``keep_id`` is gone or a
        migration owns either record."""
        now = time.time()
        with self.db.write() as s:
            rec = s.get(FileRecord, keep_id)
            busy = set(s.scalars(owned_file_ids()))
            if rec is None or rec.state == FileState.MIGRATING or rec.id in busy:
                return None
            other = s.scalar(select(FileRecord).where(FileRecord.relpath == new.relpath))
            if other is not None and other.id != rec.id:
                if other.state == FileState.MIGRATING or other.id in busy:
                    return None
                s.delete(other)
                s.flush()
            rec.relpath = new.relpath
            rec.tier = new.tier
            rec.size = new.size
            rec.mtime_ns = new.mtime_ns
            rec.checksum = new.checksum
            rec.etag = new.etag
            rec.state = FileState.STABLE
            rec.detail = None
            rec.generation += 1
            rec.updated_at = now
            s.flush()
            return rec

    def purge_missing(self) -> int:
        """Delete the records of files that are gone from disk; returns how many."""
        with self.db.write() as s:
            res = s.execute(delete(FileRecord).where(FileRecord.state == FileState.MISSING))
            return int(res.rowcount or 0)  # type: ignore[attr-defined]

    def set_state(self, file_ids: Iterable[int], state: str, detail: str | None = None) -> int:
        """Flag files (missing, conflict) as scan found them. Files a migration owns are left
        alone, checked in the same transaction: between a move's publish and its source unlink a
        file is briefly on two tiers, which is the mover's business, not a conflict."""
        ids = list(file_ids)
        if not ids:
            return 0
        with self.db.write() as s:
            res = s.execute(
                update(FileRecord)
                .where(
                    FileRecord.id.in_(ids),
                    FileRecord.state != FileState.MIGRATING,
                    FileRecord.id.not_in(owned_file_ids()),
                )
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
        with self.db.write(changes_files=False) as s:
            s.connection().exec_driver_sql(
                "UPDATE files SET heat = tierd_decay(heat, heat_at, :now, :hl) + :n, "
                "heat_at = :now, access_count = access_count + :n, last_access = :now "
                "WHERE id = :fid",
                params,
            )
