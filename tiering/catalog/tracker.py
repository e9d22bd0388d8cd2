"""The tracker's hot path: what every receiver of a distribution asks the catalog at each poll
(every 0.1 s, or less often in a large fleet: :mod:`tiering.fleet.peerwindow`), kept at a cost
that does not grow with the fleet (:meth:`Pieces.exchange
<tiering.catalog.pieces.Pieces.exchange>` and :meth:`~tiering.catalog.pieces.Pieces.mark`). On
PostgreSQL the poll is the function migration 0013 made, whose plan walks the key whatever the
table's statistics say.

A poll read every host's holding row, so the tracker's load grew as the square of the fleet:
at 100 hosts PostgreSQL and the receivers spent their time on 10,000 rows a second a host.
Now a poll reads a *window* of at most :data:`WINDOW` peers' holdings (the next hosts after a
cursor, in host-id order, wrapping round: each receiver walks the whole fleet a window at a
time, starting after its own id, so windows are spread evenly over the hosts), plus the hosts
holding a claim on the bucket (found through a partial index: the pieces a claimer just read
are the newest, and whether a claim is held decides whether to take one), each with its address
and heartbeat (so a receiver no longer reads the whole hosts table either). A poll carries the
pieces the receiver landed since the last one, so a receiver costs the catalog one transaction
a poll, whatever its link's rate. A fleet no larger than the window is read whole each poll,
as before.

Adding pieces takes no lock on the file's row: a thousand receivers taking ``KEY SHARE`` on one
row ten times a second made PostgreSQL build a multixact at nearly every poll. The file's
generation is checked by a join instead; a generation change racing a poll can leave a holding
row of the old generation, which no reader takes as a source (every read is by generation), and
which the host's next write of the new generation replaces.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, func, insert, select, text, update
from sqlalchemy.orm import Session

from tiering.catalog.models import FileRecord, HostRow, PieceHolding, PieceMap
from tiering.catalog.piecemaps import Holding, bitmap, piece_count

__all__ = [
    "WINDOW",
    "Exchange",
    "add_pieces",
    "clock",
    "holding_of_row",
    "holding_rows",
    "leaders",
    "most_complete",
    "poll",
    "tell",
    "window",
]

#: Peers' holdings one poll reads (claimers besides): BitTorrent's trackers hand a peer 50 of
#: the swarm, and a receiver keeps at most 8 pieces in flight, 4 to a peer.
WINDOW = 32


@dataclass(frozen=True)
class Exchange:
    """One poll's answer: the holdings it read (a window's and the claimers', not this host's)
    and the cursor the next poll starts after."""

    holdings: list[Holding]
    after: str


def _count(have: bytes) -> int:
    return int.from_bytes(have, "little").bit_count()


#: A holding row read with its host's address and heartbeat.
_Row = Select[int, str, int, bytes, int, float, float | None, str, float]


def holding_rows() -> _Row:
    """Holdings with their hosts' addresses and heartbeats (None: no such host)."""
    return select(
        PieceHolding.file_id,
        PieceHolding.host,
        PieceHolding.generation,
        PieceHolding.have,
        PieceHolding.pieces,
        PieceHolding.updated_at,
        PieceHolding.origin_until,
        HostRow.address,
        HostRow.last_heartbeat,
    ).outerjoin(HostRow, HostRow.host_id == PieceHolding.host)


def holding_of_row(r: Any) -> Holding:
    return Holding(
        r.file_id,
        r.host,
        r.generation,
        bytes(r.have),
        r.pieces,
        r.updated_at,
        r.origin_until,
        r.address,
        r.last_heartbeat,
    )


def add_pieces(
    s: Session, file_id: int, host: str, generation: int, verified: Iterable[int], now: float
) -> Holding | None:
    """Add ``verified`` to ``host``'s holding of ``generation`` (replacing one of another
    generation); None (nothing written) when the file is at another generation or has no map
    of this one."""
    dims = s.execute(
        select(PieceMap.size, PieceMap.piece_size)
        .join(FileRecord, FileRecord.id == PieceMap.file_id)
        .where(
            PieceMap.file_id == file_id,
            PieceMap.generation == generation,
            FileRecord.generation == generation,
        )
    ).first()
    if dims is None:
        return None
    count = piece_count(dims.size, dims.piece_size)
    new = bitmap(verified, count)
    key = (PieceHolding.file_id == file_id, PieceHolding.host == host)
    row = s.execute(
        select(PieceHolding.generation, PieceHolding.have, PieceHolding.origin_until)
        .where(*key)
        .with_for_update()
    ).first()
    claim = None
    if row is None:
        have = new
        s.execute(
            insert(PieceHolding).values(
                file_id=file_id,
                host=host,
                generation=generation,
                have=have,
                pieces=_count(have),
                origin_until=None,
                updated_at=now,
            )
        )
    else:
        old = bytes(row.have) if row.generation == generation else b""
        merged = int.from_bytes(old, "little") | int.from_bytes(new, "little")
        have = merged.to_bytes(len(new), "little")
        claim = row.origin_until if row.generation == generation else None
        s.execute(
            update(PieceHolding)
            .where(*key)
            .values(
                generation=generation,
                have=have,
                pieces=_count(have),
                origin_until=claim,
                updated_at=now,
            )
        )
    return Holding(file_id, host, generation, have, _count(have), now, claim)


# The poll's statements, as SQL that PostgreSQL and SQLite both take: built once, they cost a
# receiver a fifth of what SQLAlchemy's constructs cost it to build and compile at every poll.
_TELL = text(
    """
    INSERT INTO piece_holdings (file_id, host, generation, have, pieces, origin_until, updated_at)
    SELECT :file_id, :host, :generation, :have, :pieces, NULL, :now
    FROM piece_maps JOIN files ON files.id = piece_maps.file_id
    WHERE piece_maps.file_id = :file_id AND piece_maps.generation = :generation
      AND files.generation = :generation
    ON CONFLICT (file_id, host) DO UPDATE SET
      have = excluded.have, pieces = excluded.pieces, updated_at = excluded.updated_at,
      origin_until = CASE WHEN piece_holdings.generation = excluded.generation
                          THEN piece_holdings.origin_until END,
      generation = excluded.generation
    RETURNING host
    """
)
_COLUMNS = """h.file_id, h.host, h.generation, h.have, h.pieces, h.updated_at, h.origin_until,
    o.address, o.last_heartbeat"""
_OF = """FROM piece_holdings h LEFT JOIN hosts o ON o.host_id = h.host
    WHERE h.file_id = :file_id AND h.generation = :generation AND h.host != :me"""
# The next hosts after the cursor (the primary key's order), and the live claimers (a range of
# the partial index ix_piece_holdings_claims, keyed by the claim's end).
_WINDOW = text(
    f"""
    SELECT * FROM (SELECT {_COLUMNS}, 0 AS part {_OF} AND h.host > :after
                   ORDER BY h.host LIMIT :limit) AS ahead
    UNION ALL
    SELECT {_COLUMNS}, 1 AS part {_OF}
      AND h.origin_until IS NOT NULL AND h.origin_until > :now
    """
)
_ROUND = text(f"SELECT {_COLUMNS} {_OF} AND h.host <= :after ORDER BY h.host LIMIT :limit")
# PostgreSQL: the whole poll as one statement, the function migration 0013 made (the upsert,
# when ``:write``, the window, on from the fleet's start when the window passes its end, and the
# claimers), run in autocommit: one round trip where a transaction took four (a poll cost the
# server 0.25 ms of CPU, most of it in the round trips). The function keeps the planner from
# reading every host's row of a rollout too new for the table's statistics (see 0013). It
# answers one row when nothing was seen, so the upsert's answer (``told``) always comes back.
_POLL = text(
    "SELECT * FROM tierd_poll(:file_id, :generation, :me, :write, :have, :pieces, :now, "
    ":after, :limit)"
)


def tell(s: Session, file_id: int, host: str, generation: int, have: bytes, now: float) -> bool:
    """Set ``host``'s holding of ``generation`` to the bitmap ``have`` (every piece its fill
    verified: a fill knows them all, so a poll writes them in one statement, with no read
    first), keeping its claim if the row was of this generation; False (nothing written) when
    the file is at another generation or has no map of this one."""
    args = {"file_id": file_id, "host": host, "generation": generation, "now": now}
    args |= {"have": have, "pieces": _count(have)}
    return s.execute(_TELL, args).first() is not None


def poll(
    s: Session,
    file_id: int,
    generation: int,
    *,
    me: str,
    have: bytes | None,
    after: str,
    limit: int,
    now: float,
) -> Exchange | None:
    """:func:`tell` (with ``have``) and :func:`window` as one statement, on PostgreSQL, for a
    session in autocommit (the statement is atomic by itself); None when ``have`` was
    refused."""
    args = {"file_id": file_id, "generation": generation, "me": me, "after": after, "now": now}
    args |= {"host": me, "write": have is not None, "have": have or b"", "limit": limit}
    args["pieces"] = _count(have or b"")
    got = s.execute(_POLL, args).all()
    if have is not None and not got[0].told:
        return None
    return _gather(s, [r for r in got if r.part is not None], args, limit, wrapped=True)


def _gather(
    s: Session, got: list[Any], args: dict[str, Any], limit: int, *, wrapped: bool = False
) -> Exchange:
    """The exchange of a window's rows (part 0, in host order), the claimers' (part 1) and,
    when ``wrapped``, the rows on from the fleet's start (part 2, in host order) that fill a
    window passing the fleet's end; without, they are read here."""
    rows = [r for r in got if r.part == 0]
    if wrapped:
        rows += [r for r in got if r.part == 2]
    elif len(rows) < limit:  # the end of the fleet: on from its start
        rows += s.execute(_ROUND, args | {"limit": limit - len(rows)}).all()
    seen = {r.host for r in rows}
    found = [holding_of_row(r) for r in rows]
    found += [holding_of_row(r) for r in got if r.part == 1 and r.host not in seen]
    return Exchange(found, rows[-1].host if rows else args["after"])


def window(
    s: Session,
    file_id: int,
    generation: int,
    *,
    me: str,
    after: str,
    limit: int,
    now: float,
) -> Exchange:
    """The holdings of ``generation`` of at most ``limit`` hosts after ``after`` (wrapping
    round), and of every host with a live claim on the bucket; ``me``'s own row left out. One
    statement, and a second at the end of the fleet."""
    args = {"file_id": file_id, "generation": generation, "me": me, "after": after, "now": now}
    return _gather(s, list(s.execute(_WINDOW, args | {"limit": limit})), args, limit)


def most_complete(file_id: int, generation: int) -> _Row:
    """The holdings of ``generation`` of the file with their hosts', most complete first."""
    return (
        holding_rows()
        .where(PieceHolding.file_id == file_id, PieceHolding.generation == generation)
        .order_by(PieceHolding.pieces.desc(), PieceHolding.host)
    )


def leaders(
    s: Session, file_id: int, generation: int, *, count: int, limit: int
) -> tuple[list[Holding], int]:
    """The ``limit`` most complete holdings of ``generation`` (a fill's wide read: the seeds
    and best holders outside its windows, before it claims the bucket), and how many hosts hold
    fewer than ``count`` pieces of it (the hosts still filling: what a poll's interval is sized
    by). At a rollout's start every receiver makes this read; reading every row of a thousand
    hosts into each of a thousand receivers was the start's burst."""
    filling = func.count().filter(PieceHolding.pieces < count).over()
    q = most_complete(file_id, generation).add_columns(filling.label("filling")).limit(limit)
    rows = s.execute(q).all()
    return [holding_of_row(r) for r in rows], rows[0].filling if rows else 0


def clock(now: float | None) -> float:
    """``now``, or the time now."""
    return time.time() if now is None else now
