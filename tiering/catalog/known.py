"""The last records this process read, for the read path to fall back on while the catalog's
database cannot be reached.

On PostgreSQL nothing caches records (other hosts write them; see
:attr:`~tiering.catalog.db.Database.caches_records`), so an outage would fail every load at its
record lookup although the bytes are on this host's disks, or in the bucket, untouched. The
:class:`~tiering.catalog.repo.Catalog` keeps here each record a live read returned, and answers
from it only when the live read raised :class:`~tiering.errors.CatalogUnreachable`: a stale
record never wins over one the database gives.

Only records whose bytes this host can still read are kept: stable files on its own tiers or on
a shared tier. An object is read at the ETag its record names (``If-Match``), so a record gone
stale there fails the read, never returns other bytes; a file on this host's directories moves
only by this host's mover, which pauses during an outage with its sources authoritative.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from tiering.catalog.models import FileRecord, FileState

__all__ = ["LastKnown"]


class LastKnown:
    """A bounded map of the newest record read per file id, and which id each relpath named.

    Parameters
    ----------
    host:
        This host's id: records of files on another host's tiers are not kept.
    max_records:
        The most records kept; the least recently read go first.
    """

    def __init__(self, host: str | None, max_records: int = 32_768) -> None:
        self.host = host
        self.max_records = max_records
        self._records: OrderedDict[int, FileRecord] = OrderedDict()
        self._paths: dict[str, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def read(self, file_id: int, rec: FileRecord | None) -> None:
        """The database answered ``rec`` (None: no such record) for ``file_id``."""
        if rec is None:
            self.forget(file_id)
        else:
            self.keep(rec)

    def read_path(self, relpath: str, rec: FileRecord | None) -> None:
        """The database answered ``rec`` (None: no such record) for ``relpath``."""
        if rec is None:
            self.forget_path(relpath)
        else:
            self.keep(rec)

    def keep(self, rec: FileRecord) -> None:
        """Remember ``rec``, just read from the database (a record of a file this host cannot
        read, or one that is not stable, drops what was kept for it instead)."""
        usable = rec.state == FileState.STABLE and rec.host in (None, self.host)
        with self._lock:
            old = self._records.get(rec.id)
            if old is not None and old.generation > rec.generation:
                return  # a concurrent reader kept a newer one first
            if not usable:
                self._drop(rec.id)
                return
            if old is not None and old.relpath != rec.relpath:
                self._paths.pop(old.relpath, None)
            self._records[rec.id] = rec
            self._records.move_to_end(rec.id)
            self._paths[rec.relpath] = rec.id
            while len(self._records) > self.max_records:
                fid, gone = self._records.popitem(last=False)
                if self._paths.get(gone.relpath) == fid:
                    del self._paths[gone.relpath]

    def forget(self, file_id: int) -> None:
        """The database said there is no such record."""
        with self._lock:
            self._drop(file_id)

    def forget_path(self, relpath: str) -> None:
        """The database said no record has this relpath."""
        with self._lock:
            fid = self._paths.pop(relpath, None)
            if fid is not None:
                self._records.pop(fid, None)

    def by_id(self, file_id: int) -> FileRecord | None:
        with self._lock:
            return self._records.get(file_id)

    def by_path(self, relpath: str) -> FileRecord | None:
        with self._lock:
            fid = self._paths.get(relpath)
            rec = self._records.get(fid) if fid is not None else None
        return rec if rec is not None and rec.relpath == relpath else None

    def _drop(self, file_id: int) -> None:
        rec = self._records.pop(file_id, None)
        if rec is not None and self._paths.get(rec.relpath) == file_id:
            del self._paths[rec.relpath]
