"""The catalog's table of cached copies (see :class:`~tiering.catalog.models.Copy`).

A copy never changes where a file lives: these writes leave the file records, and the read
path's cache of them, alone (``changes_files=False``).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from tiering.catalog.backends import FOR_KEY_SHARE
from tiering.catalog.db import Database
from tiering.catalog.models import Copy, FileRecord

__all__ = ["CopyRow", "Copies"]


@dataclass(frozen=True)
class CopyRow:
    file_id: int
    host: str
    location: str
    generation: int
    size: int
    created_at: float


def _row(c: Copy) -> CopyRow:
    return CopyRow(c.file_id, c.host, c.location, c.generation, c.size, c.created_at)


class Copies:
    """Rows of cached copies over one :class:`Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def record(
        self,
        file_id: int,
        *,
        host: str,
        location: str,
        generation: int,
        size: int,
        states: Collection[str],
        now: float | None = None,
    ) -> bool:
        """Record a complete copy, in one transaction, only if the file still exists at
        ``generation`` in one of ``states``; False (nothing written) otherwise: the copy is of
        bytes the catalog no longer names, and must be dropped. Replaces an older row of the
        same file, host and location."""

        def body(s: Session) -> bool:
            # KEY SHARE: a delete of the file in flight is waited for (and then no row is
            # written), while moves and access counts go on. A switch that commits after this
            # check leaves the row at an old generation, which every reader sees as stale.
            rec = s.get(FileRecord, file_id, with_for_update=FOR_KEY_SHARE)
            if rec is None or rec.generation != generation or rec.state not in states:
                return False
            s.execute(
                delete(Copy).where(
                    Copy.file_id == file_id, Copy.host == host, Copy.location == location
                )
            )
            s.add(
                Copy(
                    file_id=file_id,
                    host=host,
                    location=location,
                    generation=generation,
                    size=size,
                    created_at=time.time() if now is None else now,
                )
            )
            return True

        # Two threads of one host recording the same copy at once: the second replaces it.
        return self.db.transact(body, changes_files=False, retry_unique=True)

    def forget(self, file_id: int, *, host: str, location: str) -> None:
        q = delete(Copy).where(
            Copy.file_id == file_id, Copy.host == host, Copy.location == location
        )
        self.db.transact(lambda s: s.execute(q), changes_files=False)

    def forget_host(
        self, host: str, *, keep: Sequence[str] = (), location: str | None = None
    ) -> int:
        """Delete the rows of ``host`` (only at ``location``, when given) except those at a
        location in ``keep``; returns how many went. Run at start: what was in memory did not
        survive the restart."""
        q = delete(Copy).where(Copy.host == host)
        if location is not None:
            q = q.where(Copy.location == location)
        if keep:
            q = q.where(Copy.location.not_in(list(keep)))
        return self.db.transact(
            lambda s: int(s.execute(q).rowcount or 0),  # type: ignore[attr-defined]
            changes_files=False,
        )

    def list(
        self, *, host: str | None = None, location: str | None = None, file_id: int | None = None
    ) -> list[CopyRow]:
        q = select(Copy).order_by(Copy.id)
        if host is not None:
            q = q.where(Copy.host == host)
        if location is not None:
            q = q.where(Copy.location == location)
        if file_id is not None:
            q = q.where(Copy.file_id == file_id)
        with self.db.read() as s:
            return [_row(c) for c in s.scalars(q)]
