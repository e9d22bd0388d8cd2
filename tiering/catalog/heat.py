"""Each host's own heat of the files on shared tiers (the ``host_heat`` table).

``files.heat`` is the fleet's heat: every host's access flush adds to the one row. Beside it,
each flush also adds to a ``host_heat`` row of the flushing host, in the same transaction, so
that a host can tell the files *it* reads from those the fleet reads.

Only files on shared tiers (object stores: records that name no host) get host rows. They are
the only files whose heat differs between hosts: a file on a host's own tier is read by that
host alone, so its heat is that host's, and writing it twice would double the flush's work for
nothing. A file's host rows are what it earned while shared: one moved onto a shared tier
starts at none (it was cold, or it would not have gone there), and ``files.heat`` may exceed
the sum of the rows by the heat it earned before (on a host's tier, or before tierd kept host
rows). Decay is linear, so the rows of a file add up to its fleet heat otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Executable,
    Float,
    String,
    Table,
    bindparam,
    func,
    select,
    update,
)
from sqlalchemy import cast as cast_
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.sql.selectable import CTE

from tiering.catalog.backends import SQLITE, decay, decayed_heat
from tiering.catalog.db import Database
from tiering.catalog.models import FileRecord, HostHeat

__all__ = ["HostHeatRow", "HostHeats", "access_statements", "host_heat_upsert"]

_FILES = cast(Table, FileRecord.__table__)
_HH = cast(Table, HostHeat.__table__)


@dataclass(frozen=True)
class HostHeatRow:
    """One host's heat of one file, decayed to the instant it was read at."""

    host: str
    heat: float
    access_count: int
    last_access: float | None


@functools.cache
def access_statements(dialect: str, *, per_host: bool) -> tuple[Executable, Executable | None]:
    """The access flush's statements on ``dialect``: (the files update, this host's rows, or
    None where they are in the first or not kept). Built once: building them costs more Python
    time than SQLite takes to run them.

    SQLite: the files update runs once per file (``executemany``: ``fid``, ``n``), then the
    host rows' statement once (``counts``). PostgreSQL: one statement over arrays (``ids``,
    ``ns``), with the host rows' upsert fed by the update as a CTE when ``per_host``. Both take
    ``now``, ``hl`` and ``for_host``.
    """
    heat = partial(decayed_heat, dialect, _FILES.c.heat, _FILES.c.heat_at)
    if dialect == SQLITE:
        n = bindparam("n", type_=BigInteger)
        files = (
            update(_FILES)
            .where(_FILES.c.id == bindparam("fid"))
            .values(
                heat=heat() + n,
                heat_at=bindparam("now"),
                access_count=_FILES.c.access_count + n,
                last_access=bindparam("now"),
            )
        )
        return files, host_heat_upsert(dialect) if per_host else None
    v = (
        func.unnest(
            bindparam("ids", type_=ARRAY(BigInteger)), bindparam("ns", type_=ARRAY(BigInteger))
        )
        .table_valued("id", "n")
        .render_derived(name="v")
    )
    files = (
        update(_FILES)
        .where(_FILES.c.id == v.c.id)
        .values(
            heat=heat() + v.c.n,
            heat_at=bindparam("now"),
            access_count=_FILES.c.access_count + v.c.n,
            last_access=bindparam("now"),
        )
    )
    if not per_host:
        return files, None
    # One statement still: the files update as a CTE that feeds this host's rows.
    updated = files.returning(_FILES.c.id, _FILES.c.host, v.c.n).cte("updated")
    return host_heat_upsert(dialect, updated), None


def host_heat_upsert(dialect: str, updated: CTE | None = None) -> Executable:
    """The statement that adds a flush's accesses to this host's rows: decay each row to
    ``:now`` and add the count, or insert it, for the files on shared tiers only.

    On PostgreSQL ``updated`` is the flush's ``UPDATE files ... RETURNING id, host, n`` as a
    CTE, so the whole flush is one statement; the rows it updated are locked by then, so a file
    deleted meanwhile gets no row (the foreign key holds). On SQLite it is one statement over
    ``:counts``, a JSON object of file id -> count (``json_each``), run after the files update in
    its transaction: a flush of files on a host's own tiers then costs one index look-up each,
    in SQLite's C, rather than a statement each. Bind parameters: ``for_host``, ``now``, ``hl``
    (and ``counts`` on SQLite).
    """
    host = bindparam("for_host", type_=String)
    now = bindparam("now", type_=Float)
    if dialect == SQLITE:
        j = func.json_each(bindparam("counts", type_=String)).table_valued("key", "value")
        j = j.alias("j")
        n = cast_(j.c.value, BigInteger)
        src = (
            select(_FILES.c.id, host, n, now, n, now)
            .select_from(j.join(_FILES, _FILES.c.id == cast_(j.c.key, BigInteger)))
            # ``host || ''``, NULL exactly where host is: an expression, so SQLite's planner
            # looks each id up rather than walk ix_files_host and scan the JSON for every file
            # (100x slower for 256 files). SQLite's upsert also needs this WHERE to parse.
            .where(_FILES.c.host.concat("").is_(None))
        )
        ins: Any = sqlite_insert(_HH)
    else:
        assert updated is not None
        src = select(updated.c.id, host, updated.c.n, now, updated.c.n, now).where(
            updated.c.host.is_(None)
        )
        ins = pg_insert(_HH)
    cols = ["file_id", "host", "heat", "heat_at", "access_count", "last_access"]
    stmt = ins.from_select(cols, src)
    return cast(
        Executable,
        stmt.on_conflict_do_update(
            index_elements=[_HH.c.file_id, _HH.c.host],
            set_={
                "heat": decayed_heat(dialect, _HH.c.heat, _HH.c.heat_at) + stmt.excluded.heat,
                "heat_at": stmt.excluded.heat_at,
                "access_count": _HH.c.access_count + stmt.excluded.access_count,
                "last_access": stmt.excluded.last_access,
            },
        ),
    )


class HostHeats:
    """Reads of the ``host_heat`` rows over one :class:`Database` (the access flush writes
    them: :meth:`tiering.catalog.Catalog.record_accesses`)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def of(
        self, file_ids: Collection[int], *, now: float, half_life_s: float
    ) -> dict[int, dict[str, HostHeatRow]]:
        """Per file of ``file_ids``, every host's row, its heat decayed to ``now``, hottest host
        first; a file no host has a row for is left out."""
        ids = sorted(set(file_ids))
        out: dict[int, dict[str, HostHeatRow]] = {}
        rows: list[HostHeat] = []
        with self.db.read() as s:
            for i in range(0, len(ids), 500):
                q = select(HostHeat).where(HostHeat.file_id.in_(ids[i : i + 500]))
                rows.extend(s.scalars(q))
        now_rows = [
            (
                r.file_id,
                HostHeatRow(
                    r.host,
                    decay(r.heat, r.heat_at, now, half_life_s),
                    int(r.access_count),
                    r.last_access,
                ),
            )
            for r in rows
        ]
        for fid, row in sorted(now_rows, key=lambda fr: (fr[0], -fr[1].heat, fr[1].host)):
            out.setdefault(fid, {})[row.host] = row
        return out

    def raw(self, host: str) -> dict[int, tuple[float, float]]:
        """Every row of ``host``: file id -> (heat, heat_at), undecayed, for a planner that
        decays with the half-life of the policy it plans with. One query, by the host index."""
        q = select(HostHeat.file_id, HostHeat.heat, HostHeat.heat_at).where(HostHeat.host == host)
        with self.db.read() as s:
            return {int(fid): (float(h), float(at)) for fid, h, at in s.execute(q)}
