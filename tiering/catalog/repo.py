"""The catalog repository: every query and write of file records goes through here.

Kept whole past 450 lines: it is every file-record query; the journal, pieces, copies and hosts
have modules of their own.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import Session

from tiering.catalog.backends import FOR_DELETE, FOR_WRITE, relax_commit
from tiering.catalog.db import Database
from tiering.catalog.heat import access_statements
from tiering.catalog.known import LastKnown
from tiering.catalog.models import FileRecord, FileState, owned_file_ids
from tiering.catalog.newfile import NewFile, TierUsage, is_same_content
from tiering.errors import AlreadyExists, CatalogUnreachable, FileNotFound

__all__ = ["Catalog", "NewFile", "TierUsage"]


def _escape_like(prefix: str) -> str:
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


#: Records a page of :meth:`Catalog.by_relpath` holds at least on PostgreSQL, where each page
#: sorts the table (a million records: a hundred sorts, not thousands).
PG_PAGE = 10_000


class Catalog:
    """File records over one :class:`Database`.

    Reads may run on any thread. Writes are serialised by SQLite's single writer; on
    PostgreSQL each locks the records it decides on first (in id order where it takes several),
    so writers on other hosts wait for it rather than both win. Returned records are detached
    snapshots: changing them changes nothing.
    """

    def __init__(self, db: Database) -> None:
        self.db = db
        self._cache: dict[int, tuple[FileRecord, tuple[int, int]]] = {}
        self._paths: dict[str, tuple[int, int]] = {}  # relpath -> (file id, generation)
        # Where records are not cached (PostgreSQL), the last ones read: the read path's
        # answer while the database cannot be reached (see tiering.catalog.known).
        self.last_known = None if db.caches_records else LastKnown(db.host)

    # -- reads -------------------------------------------------------------------------------
    def get(self, file_id: int, *, cached: bool = False) -> FileRecord:
        """One record. ``cached`` may answer from memory, for the read path: the record's place,
        state and content are current, its access counters may lag the last flush; and while
        the database cannot be reached, the last record read of a file this host can read."""
        rec = self._cache_get(file_id) if cached else None
        if rec is None:
            stamp = self.db.stamp(file_id)
            try:
                with self.db.read() as s:
                    rec = s.get(FileRecord, file_id)
            except CatalogUnreachable:
                known = self.last_known.by_id(file_id) if cached and self.last_known else None
                if known is None:
                    raise
                return known
            if rec is not None:
                self._cache_put(file_id, rec, stamp)
            if self.last_known is not None:
                self.last_known.read(file_id, rec)
        if rec is None:
            raise FileNotFound(f"no file with id {file_id}", file_id=file_id)
        return rec

    def lookup(self, relpath: str, *, cached: bool = False) -> FileRecord:
        """One record by relpath; ``cached`` as for :meth:`get`."""
        fallback = self.last_known if cached else None
        cached = cached and self.db.caches_records
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
        try:
            with self.db.read() as s:
                found = s.scalar(select(FileRecord).where(FileRecord.relpath == relpath))
        except CatalogUnreachable:
            known = fallback.by_path(relpath) if fallback is not None else None
            if known is None:
                raise
            return known
        if self.last_known is not None:
            self.last_known.read_path(relpath, found)
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
    # Only where this process is the only writer (Database.caches_records): on PostgreSQL
    # another host's move or upload would leave a kept record stale, and a stale generation
    # would serve an old resident copy; there every read asks the database (one round trip).
    _CACHE_MAX = 65_536

    def _cache_get(self, file_id: int) -> FileRecord | None:
        if not self.db.caches_records:
            return None
        hit = self._cache.get(file_id)
        if hit is None or hit[1] != self.db.stamp(file_id):
            return None
        return hit[0]

    def _cache_put(self, file_id: int, rec: FileRecord, stamp: tuple[int, int]) -> None:
        if not self.db.caches_records:
            return
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

    def by_relpath(self, batch: int = 1000) -> Iterator[FileRecord]:
        """Every record in relpath order (of code points, as tiers walk), read in keyset pages
        (each its own read): a scan compares millions of files with the catalog in bounded
        memory.

        SQLite's order (bytes, which for UTF-8 is code point order) follows the relpath index,
        ``batch`` records a page. PostgreSQL compares in its ``"C"`` collation, since the
        database's own may be a language's; its relpath index follows that one, so each page
        is a sort of the table, and pages there hold at least :data:`PG_PAGE` records.
        """
        key: Any = FileRecord.relpath
        if not self.db.single_writer:
            key, batch = FileRecord.relpath.collate("C"), max(batch, PG_PAGE)
        after: str | None = None
        while True:
            q = select(FileRecord)
            if after is not None:
                q = q.where(key > after)
            with self.db.read() as s:
                page = list(s.scalars(q.order_by(key).limit(batch)))
            yield from page
            if len(page) < batch:
                return
            after = page[-1].relpath

    def compressed_on(self, tier: str) -> list[FileRecord]:
        """The records of this host's files that ``tier`` stores with a codec."""
        mine = or_(FileRecord.host.is_(None), FileRecord.host == self.db.host)
        q = select(FileRecord).where(mine, FileRecord.tier == tier, FileRecord.codec.is_not(None))
        with self.db.read() as s:
            return list(s.scalars(q))

    def actionable(self) -> list[FileRecord]:
        """Records this host may plan moves for: those on its own tiers and on shared tiers
        (no host). Another host's files are on its disks, which this host cannot reach."""
        q = select(FileRecord).where(
            or_(FileRecord.host.is_(None), FileRecord.host == self.db.host)
        )
        with self.db.read() as s:
            return list(s.scalars(q.order_by(FileRecord.id)))

    def usage(self) -> dict[str, TierUsage]:
        """Files and bytes per tier, by the catalog (missing files are not counted)."""
        q = (
            select(
                FileRecord.tier,
                func.count(),
                func.coalesce(func.sum(FileRecord.size), 0),
                func.coalesce(func.sum(func.coalesce(FileRecord.stored_size, FileRecord.size)), 0),
            )
            .where(FileRecord.state != FileState.MISSING)
            .group_by(FileRecord.tier)
        )
        with self.db.read() as s:
            return {t: TierUsage(int(n), int(b), int(st)) for t, n, b, st in s.execute(q)}

    def busy_file_ids(self) -> set[int]:
        """Files with an open migration intent: the mover owns them until it closes."""
        with self.db.read() as s:
            return {fid for fid in s.scalars(owned_file_ids()) if fid is not None}

    def count(self) -> int:
        with self.db.read() as s:
            return int(s.scalar(select(func.count()).select_from(FileRecord)) or 0)

    # -- writes ------------------------------------------------------------------------------
    def upsert(
        self, new: NewFile, *, now: float | None = None, new_only: bool = False
    ) -> FileRecord | None:
        """Record bytes just published at ``new.relpath``; see :meth:`upsert_many`."""
        return self.upsert_many([new], now=now, new_only=new_only)[0]

    def upsert_many(
        self, news: Sequence[NewFile], *, now: float | None = None, new_only: bool = False
    ) -> list[FileRecord | None]:
        """Record bytes just published, in one transaction: insert each, or replace the content
        of the existing record (keeping its id, heat and pin) and bump its generation.

        A record owned by a migration is left alone, and its slot in the result is None.
        ``new_only``: raise :class:`AlreadyExists` (nothing recorded) where a record exists,
        e.g. one another host inserted while this one uploaded a file it found new.
        """
        now = time.time() if now is None else now

        def body(s: Session) -> list[FileRecord | None]:
            out: list[FileRecord | None] = []
            q = (
                select(FileRecord)
                .where(FileRecord.relpath.in_([n.relpath for n in news]))
                .order_by(FileRecord.id)
                .with_for_update(**FOR_WRITE)
            )
            existing = {r.relpath: r for r in s.scalars(q)}
            for new in news:
                rec = existing.get(new.relpath)
                if rec is not None and new_only:
                    raise AlreadyExists(
                        f"{new.relpath!r} was created meanwhile (id {rec.id}, tier {rec.tier})",
                        path=new.relpath,
                        file_id=rec.id,
                    )
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
                elif is_same_content(rec, new):
                    # The same published bytes recorded twice (a scan that listed a file just
                    # before its upload committed): the content has not changed, so neither
                    # does the generation that peers, leases and copies are keyed on.
                    out.append(rec)
                    continue
                else:
                    rec.generation += 1
                self._take(rec, new, now)
                out.append(rec)
            s.flush()
            return out

        # Another host may insert one of these relpaths first: then this runs again and
        # updates its record instead.
        return self.db.transact(body, retry_unique=True)

    def _take(self, rec: FileRecord, new: NewFile, now: float) -> None:
        """Give ``rec`` the published bytes ``new`` describes, stable as of ``now`` (its id,
        heat, pin and generation are the caller's: upsert and reassign bump it differently)."""
        rec.tier = new.tier
        rec.host = self.db.owner_of(new.tier)
        rec.size = new.size
        rec.mtime_ns = new.mtime_ns
        rec.checksum = new.checksum
        rec.etag = new.etag
        rec.codec, rec.stored_size = new.codec, new.stored_size
        rec.state = FileState.STABLE
        rec.detail = None
        rec.updated_at = now

    def existing_ids(self, file_ids: Iterable[int]) -> set[int]:
        """Those of ``file_ids`` that still have a record (ids are never reused: 0003)."""
        wanted = sorted(set(file_ids))
        found: set[int] = set()
        with self.db.read() as s:
            for i in range(0, len(wanted), 500):
                q = select(FileRecord.id).where(FileRecord.id.in_(wanted[i : i + 500]))
                found.update(s.scalars(q))
        return found

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
        new = NewFile(new_relpath, rec.tier, rec.size, rec.mtime_ns, rec.checksum, rec.etag)
        return self.reassign(rec.id, replace(new, codec=rec.codec, stored_size=rec.stored_size))

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

        def body(s: Session) -> FileRecord | None:
            # FOR UPDATE, not NO KEY: the relpath is a key (unique), and it changes.
            rec = s.get(FileRecord, keep_id, with_for_update=FOR_DELETE)
            if rec is None or rec.state == FileState.MIGRATING:
                return None
            q = select(FileRecord).where(FileRecord.relpath == new.relpath)
            other = s.scalar(q.with_for_update(**FOR_DELETE))
            busy = set(s.scalars(owned_file_ids()))
            if rec.id in busy:
                return None
            if other is not None and other.id != rec.id:
                if other.state == FileState.MIGRATING or other.id in busy:
                    return None
                s.delete(other)
                s.flush()
            rec.relpath = new.relpath
            rec.generation += 1
            self._take(rec, new, now)
            s.flush()
            return rec

        return self.db.transact(body, retry_unique=True)

    def purge_missing(self) -> int:
        """Delete the records of files that are gone from disk; returns how many."""

        def body(s: Session) -> int:
            # Under READ COMMITTED a record that a scan made stable meanwhile is re-checked
            # against the condition after its lock is free, and stays.
            res = s.execute(delete(FileRecord).where(FileRecord.state == FileState.MISSING))
            return int(res.rowcount or 0)  # type: ignore[attr-defined]

        return self.db.transact(body)

    def set_state(self, file_ids: Iterable[int], state: str, detail: str | None = None) -> int:
        """Flag files (missing, conflict) as scan found them. Files a migration owns are left
        alone, checked in the same transaction: between a move's publish and its source unlink a
        file is briefly on two tiers, which is the mover's business, not a conflict."""
        ids = sorted(set(file_ids))
        if not ids:
            return 0

        def body(s: Session) -> int:
            # Lock in id order first, as every multi-record write does (no deadlock among them);
            # a claim that committed meanwhile shows as ``migrating`` below.
            s.execute(
                select(FileRecord.id)
                .where(FileRecord.id.in_(ids))
                .order_by(FileRecord.id)
                .with_for_update(**FOR_WRITE)
            )
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

        return self.db.transact(body)

    def delete(
        self,
        file_id: int,
        *,
        generation: int | None = None,
        before_commit: Callable[[FileRecord], object] | None = None,
    ) -> bool:
        """Remove a record; with ``generation``, only if it is still at that generation. A record
        a migration owns is never removed (False): its mover, perhaps on another host, is
        copying it.

        ``before_commit`` runs inside the write transaction, with the record locked (SQLite's
        write lock, or its row on PostgreSQL): if it raises, the record stays. Deleting a file's
        bytes there means a busy catalog can never leave bytes deleted under a live record.
        """
        unlinked = False

        def body(s: Session) -> bool:
            nonlocal unlinked
            rec = s.get(FileRecord, file_id, with_for_update=FOR_DELETE)
            if rec is None or (generation is not None and rec.generation != generation):
                return False
            if rec.state == FileState.MIGRATING or rec.id in set(s.scalars(owned_file_ids())):
                return False
            s.delete(rec)
            s.flush()
            if before_commit is not None:
                unlinked = True
                before_commit(rec)
            return True

        # Never run twice once the bytes are gone: the record is then left for scan to flag.
        return self.db.transact(body, may_retry=lambda: not unlinked)

    def record_accesses(self, counts: Mapping[int, int], *, now: float, half_life_s: float) -> None:
        """Add accesses in one batch: decay each file's heat to ``now``, then add the count.

        Rows are updated in id order, so two hosts flushing overlapping batches wait for each
        other rather than deadlock (and transact() retries one that did). On PostgreSQL the
        batch is one statement over arrays, one round trip, and its commit does not wait for
        the WAL flush: RELIABILITY.md lets access counters be written with ``NORMAL``, so a
        crash may lose the last flush, never corrupt anything.

        The accesses of files on shared tiers also go to this host's ``host_heat`` rows, in the
        same transaction (see :mod:`tiering.catalog.heat`); on PostgreSQL in the same statement.
        """
        if not counts:
            return
        ordered = sorted(counts.items())
        host = self.db.host  # None: a catalog with no host ids keeps no host rows
        files, per_host = access_statements(self.db.backend, per_host=host is not None)
        # No parameter may be named after a column of files: an UPDATE sets such columns.
        common: dict[str, Any] = {"now": now, "hl": half_life_s, "for_host": host}
        params: Any
        if self.db.single_writer:
            params = [{"fid": fid, "n": k} | common for fid, k in ordered]
        else:
            params = {"ids": [f for f, _ in ordered], "ns": [k for _, k in ordered]} | common
        host_params = {} if per_host is None else common | {"counts": json.dumps(dict(ordered))}

        def body(s: Session) -> None:
            if not self.db.single_writer:
                relax_commit(s)
            s.connection().execute(files, params)
            if per_host is not None:
                s.connection().execute(per_host, host_params)

        self.db.transact(body, changes_files=False)
