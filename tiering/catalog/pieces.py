"""The catalog's pieces: each file generation's piece digests, and which host has verified
which pieces of it (see :class:`~tiering.catalog.models.PieceMap` and
:class:`~tiering.catalog.models.PieceHolding`).

The promises:

- a map is tied to one generation of one file, and is written only while the file is at that
  generation; it is opened empty (:meth:`Pieces.open_map`) and grows a digest at a time as
  the host reading the generation from the bucket lands each piece (:meth:`Pieces.land`), so
  receivers check and relay pieces while that fill runs. A piece's digest is written once:
  the first recorder wins, and a second recorder with other bytes is refused (it read
  something else and must not distribute it). The map is ``final`` once the bucket reader's
  whole-file checksum matched; a fill whose checksum failed deletes the unfinished map
  (:meth:`Pieces.drop_unfinished`). One row a generation, grown in place, rather than a row a
  piece: a receiver reads every digest it needs in one primary-key look-up, and a 70 GB
  model's map stays one 134 KB row;
- opening a map deletes the maps and holdings of the file's other generations, so no host
  picks a source, or checks a piece, by an old generation's digests;
- a holding grows only while the file is at its generation; a holding of another generation
  is never returned as a source;
- at most K hosts read a generation from the bucket at once: a claim (``origin_until``) in
  the host's holding row, taken under the map's row lock (:meth:`Pieces.claim_origin`),
  renewed as the claimer's pieces land, and dead once it expires.

These writes change no file's place or content (``changes_files=False``). A receiver's poll,
the tracker's hot path, is :mod:`tiering.catalog.tracker`'s.

Kept whole past 450 lines: one class for the two tables, whose writes share the promises above.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Sequence

from sqlalchemy import Select, delete, select
from sqlalchemy.orm import Session

from tiering.catalog.backends import FOR_KEY_SHARE, FOR_UPDATE_UNQUEUED
from tiering.catalog.db import Database
from tiering.catalog.models import FileRecord, PieceHolding, PieceMap
from tiering.catalog.piecemaps import (
    WIDTH,
    Holding,
    PieceDigests,
    bitmap,
    bits_of,
    digests_of,
    holding_of,
    piece_count,
)
from tiering.catalog.tracker import (
    WINDOW,
    Exchange,
    add_pieces,
    clock,
    holding_of_row,
    leaders,
    most_complete,
    poll,
    tell,
    window,
)
from tiering.errors import IntegrityError

__all__ = ["WINDOW", "Exchange", "Holding", "PieceDigests", "Pieces", "bitmap", "bits_of"]


def _drop_others(s: Session, file_id: int, generation: int) -> None:
    q = delete(PieceMap).where(PieceMap.file_id == file_id, PieceMap.generation != generation)
    s.execute(q)
    s.execute(
        delete(PieceHolding).where(
            PieceHolding.file_id == file_id, PieceHolding.generation != generation
        )
    )


def _claimers(file_id: int, generation: int, host: str, now: float) -> Select[str]:
    """The hosts other than ``host`` with a live claim on reading ``generation`` from the bucket
    (a range of ix_piece_holdings_claims, by the claim's end)."""
    return select(PieceHolding.host).where(
        PieceHolding.file_id == file_id,
        PieceHolding.generation == generation,
        PieceHolding.host != host,
        PieceHolding.origin_until.is_not(None),
        PieceHolding.origin_until > now,
    )


def _my_row(s: Session, file_id: int, host: str, generation: int, count: int) -> PieceHolding:
    """``host``'s holding row of the file, locked, reset if it was of another generation."""
    row = s.get(PieceHolding, (file_id, host), with_for_update=True)
    if row is None:
        row = PieceHolding(
            file_id=file_id,
            host=host,
            generation=generation,
            have=bytes((count + 7) // 8),
            pieces=0,
            origin_until=None,
            updated_at=time.time(),
        )
        s.add(row)
    elif row.generation != generation:
        row.generation, row.have, row.pieces = generation, bytes((count + 7) // 8), 0
        row.origin_until = None
    return row


def _at(s: Session, file_id: int, generation: int, states: Collection[str] | None) -> bool:
    # KEY SHARE: a delete of the file waits for this transaction (and then cascades what it
    # wrote), while moves and access counts go on.
    rec = s.get(FileRecord, file_id, with_for_update=FOR_KEY_SHARE)
    return (
        rec is not None and rec.generation == generation and (states is None or rec.state in states)
    )


def _new_map(
    s: Session,
    file_id: int,
    generation: int,
    size: int,
    piece_size: int,
    algorithm: str,
    host: str,
    now: float | None,
    *,
    digests: bytes,
    known: bytes,
    final: bool,
) -> PieceMap:
    """A new map row of ``generation``, flushed (a second recorder's insert then conflicts)."""
    row = PieceMap(
        file_id=file_id,
        generation=generation,
        size=size,
        piece_size=piece_size,
        algorithm=algorithm,
        digests=digests,
        known=known,
        final=final,
        recorded_by=host,
        created_at=time.time() if now is None else now,
    )
    s.add(row)
    s.flush()
    return row


class Pieces:
    """Piece maps and holdings over one :class:`Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def record_map(
        self,
        file_id: int,
        *,
        generation: int,
        size: int,
        piece_size: int,
        algorithm: str,
        digests: Sequence[bytes],
        host: str,
        states: Collection[str] | None = None,
        now: float | None = None,
    ) -> PieceDigests | None:
        """Record ``generation``'s digests unless a map of it exists; returns the map that
        holds (the first recorder's), or None (nothing written) when the file is gone or at
        another generation (or not in ``states``). Deletes the other generations' maps and
        holdings."""
        width = WIDTH.get(algorithm)
        if width is None:
            raise ValueError(f"unknown piece digest algorithm {algorithm!r}")
        if piece_size <= 0 or size < 0 or len(digests) != piece_count(size, piece_size):
            raise ValueError(f"{len(digests)} digests do not cover {size} bytes by {piece_size}")
        if any(len(d) != width for d in digests):
            raise ValueError(f"{algorithm} digests are {width} bytes each")

        def body(s: Session) -> PieceDigests | None:
            if not _at(s, file_id, generation, states):
                return None
            _drop_others(s, file_id, generation)
            found = s.get(PieceMap, (file_id, generation)) or _new_map(
                s,
                file_id,
                generation,
                size,
                piece_size,
                algorithm,
                host,
                now,
                digests=b"".join(digests),
                known=bitmap(range(len(digests)), len(digests)),
                final=True,
            )
            return digests_of(found)

        # Two hosts recording the first map at once: the loser finds the winner's on retry.
        return self.db.transact(body, changes_files=False, retry_unique=True)

    def open_map(
        self,
        file_id: int,
        *,
        generation: int,
        size: int,
        piece_size: int,
        algorithm: str,
        host: str,
        now: float | None = None,
    ) -> PieceDigests | None:
        """The map of ``generation``, opened empty (no digest known, not final) unless one
        exists; None (nothing written) when the file is gone or at another generation.
        Deletes the other generations' maps and holdings."""
        width = WIDTH.get(algorithm)
        if width is None:
            raise ValueError(f"unknown piece digest algorithm {algorithm!r}")
        count = piece_count(size, piece_size)

        def body(s: Session) -> PieceDigests | None:
            if not _at(s, file_id, generation, None):
                return None
            found = s.get(PieceMap, (file_id, generation))
            if found is None:
                _drop_others(s, file_id, generation)
                found = _new_map(
                    s,
                    file_id,
                    generation,
                    size,
                    piece_size,
                    algorithm,
                    host,
                    now,
                    digests=bytes(count * width),
                    known=bytes((count + 7) // 8),
                    final=False,
                )
            return digests_of(found)

        return self.db.transact(body, changes_files=False, retry_unique=True)

    def land(
        self,
        file_id: int,
        *,
        host: str,
        generation: int,
        index: int,
        digest: bytes | None = None,
        origin_ttl_s: float | None = None,
        now: float | None = None,
    ) -> PieceDigests | None:
        """``host`` verified piece ``index`` of ``generation`` and can serve it: its holding
        gains the piece, and, with ``digest`` (the piece was read from the authority), the map
        gains its digest unless it has one. ``origin_ttl_s`` renews ``host``'s claim on the
        bucket. Returns the map as it is now, or None (nothing written) when the file is gone,
        at another generation, or has no map of ``generation``.

        Raises :class:`~tiering.errors.IntegrityError` when the map has another digest for
        the piece: ``host`` read other bytes than the first recorder (nothing written)."""
        stamp = time.time() if now is None else now

        def body(s: Session) -> PieceDigests | None:
            if not _at(s, file_id, generation, None):
                return None
            m = s.get(PieceMap, (file_id, generation), with_for_update=digest is not None)
            if m is None:
                return None
            width, count = WIDTH[m.algorithm], piece_count(m.size, m.piece_size)
            if not 0 <= index < count:
                raise ValueError(f"piece {index} is outside 0..{count - 1}")
            if digest is not None:
                known = bytearray(m.known)
                at = slice(index * width, (index + 1) * width)
                if known[index // 8] >> (index % 8) & 1:
                    if bytes(m.digests)[at] != digest:
                        raise IntegrityError(
                            f"piece {index} of file {file_id} at generation {generation} was "
                            "read with other bytes than its recorded digest's",
                            file_id=file_id,
                            piece=index,
                        )
                else:
                    digests = bytearray(m.digests)
                    digests[at] = digest
                    known[index // 8] |= 1 << (index % 8)
                    m.digests, m.known = bytes(digests), bytes(known)
            row = _my_row(s, file_id, host, generation, count)
            have = bytearray(row.have)
            if not have[index // 8] >> (index % 8) & 1:
                have[index // 8] |= 1 << (index % 8)
                row.have, row.pieces = bytes(have), row.pieces + 1
            if origin_ttl_s is not None and row.origin_until is not None:
                row.origin_until = stamp + origin_ttl_s
            row.updated_at = stamp
            s.flush()
            return digests_of(m)

        return self.db.transact(body, changes_files=False, retry_unique=True)

    def finalize(self, file_id: int, generation: int) -> bool:
        """Mark ``generation``'s map final (its bucket reader's whole-file checksum matched):
        True when it is, False when it is gone or still lacks digests."""

        def body(s: Session) -> bool:
            m = s.get(PieceMap, (file_id, generation), with_for_update=True)
            if m is None:
                return False
            count = piece_count(m.size, m.piece_size)
            if len(bits_of(bytes(m.known), count)) != count:
                return False
            m.final = True
            return True

        return self.db.transact(body, changes_files=False)

    def drop_unfinished(self, file_id: int, generation: int) -> None:
        """The bytes read for ``generation`` failed its whole-file checksum: delete its map,
        unless final, and every holding of it (pieces verified against that map)."""

        def body(s: Session) -> None:
            m = s.get(PieceMap, (file_id, generation), with_for_update=True)
            if m is None or m.final:
                return
            s.delete(m)
            s.execute(
                delete(PieceHolding).where(
                    PieceHolding.file_id == file_id, PieceHolding.generation == generation
                )
            )

        self.db.transact(body, changes_files=False)

    def claim_origin(
        self,
        file_id: int,
        *,
        host: str,
        generation: int,
        readers: int,
        ttl_s: float,
        now: float | None = None,
    ) -> bool:
        """Claim a place among the at most ``readers`` hosts reading ``generation`` from the
        bucket (claims expire ``ttl_s`` after their last renewal); True when ``host`` holds
        one (taken now or already), False when they are all taken or the map is gone. The
        map's row lock orders claimers, on PostgreSQL and SQLite alike.

        The places are counted first without the lock: when they are all taken, as they are
        for nearly every host of a large fleet, nobody queues on the map's row to learn it
        (1,000 hosts asking: two thirds of PostgreSQL's busy backends waited on that lock).
        A place freed meanwhile is taken at the next poll's claim. Nor does a claim wait while
        another host holds the lock (``SKIP LOCKED``): it answers False, and the fill tries
        again at its next poll (at a rollout's start every receiver found the places free, and
        a thousand queued on the row for a second)."""
        stamp = time.time() if now is None else now
        with self.db.read() as s:
            if len(s.scalars(_claimers(file_id, generation, host, stamp)).all()) >= readers:
                return False

        def body(s: Session) -> bool:
            if not _at(s, file_id, generation, None):
                return False
            m = s.get(PieceMap, (file_id, generation), with_for_update=FOR_UPDATE_UNQUEUED)
            if m is None:  # gone, or another host is claiming
                return False
            if len(s.scalars(_claimers(file_id, generation, host, stamp)).all()) >= readers:
                return False
            row = _my_row(s, file_id, host, generation, piece_count(m.size, m.piece_size))
            row.origin_until = stamp + ttl_s
            row.updated_at = stamp
            return True

        return self.db.transact(body, changes_files=False, retry_unique=True)

    def release_origin(self, file_id: int, *, host: str) -> None:
        """``host`` stopped reading the file from the bucket."""

        def body(s: Session) -> None:
            row = s.get(PieceHolding, (file_id, host), with_for_update=True)
            if row is not None:
                row.origin_until = None

        self.db.transact(body, changes_files=False)

    def map(self, file_id: int, generation: int) -> PieceDigests | None:
        """The digests of ``generation`` of the file, if recorded."""
        with self.db.read() as s:
            m = s.get(PieceMap, (file_id, generation))
            return None if m is None else digests_of(m)

    def mark(
        self,
        file_id: int,
        *,
        host: str,
        generation: int,
        verified: Iterable[int],
        now: float | None = None,
    ) -> Holding | None:
        """Add ``verified`` pieces to ``host``'s holding of ``generation`` (replacing a
        holding of another generation); returns the holding, or None (nothing written) when
        the file is gone, at another generation, or has no map of ``generation``."""
        wanted = sorted(set(verified))
        at = clock(now)
        return self.db.transact(
            lambda s: add_pieces(s, file_id, host, generation, wanted, at),
            changes_files=False,
            retry_unique=True,
        )

    def exchange(
        self,
        file_id: int,
        *,
        host: str,
        generation: int,
        have: bytes | None = None,
        after: str = "",
        limit: int = WINDOW,
        now: float | None = None,
    ) -> Exchange | None:
        """One receiver's poll (see :mod:`tiering.catalog.tracker`): set ``host``'s holding
        to ``have`` as :meth:`tell` does (when given), and read the holdings of
        ``generation`` of at most ``limit`` hosts after ``after`` (wrapping round) and of the
        hosts with a live claim on the bucket, with their addresses and heartbeats, in one
        transaction. None (nothing written) when ``have`` was refused."""
        at = clock(now)

        def body(s: Session) -> Exchange | None:
            if have is not None and not tell(s, file_id, host, generation, have, at):
                return None
            return window(s, file_id, generation, me=host, after=after, limit=limit, now=at)

        if not self.db.single_writer:  # PostgreSQL: one statement, in autocommit
            if have is not None:
                self.db._before_write()  # a fenced host writes nothing
            with self.db.read() as s:
                return poll(
                    s, file_id, generation, me=host, have=have, after=after, limit=limit, now=at
                )
        if have is None:
            with self.db.read() as s:
                return body(s)
        return self.db.transact(body, changes_files=False)

    def tell(
        self, file_id: int, *, host: str, generation: int, have: bytes, now: float | None = None
    ) -> bool:
        """Set ``host``'s holding of ``generation`` to the bitmap ``have``: every piece its
        fill verified (a poll's write: one statement, no read first; :meth:`mark` adds pieces
        to what the row holds). Its claim on the bucket is kept. False (nothing written) when
        the file is gone, at another generation, or has no map of ``generation``."""
        at = clock(now)
        return self.db.transact(
            lambda s: tell(s, file_id, host, generation, have, at), changes_files=False
        )

    def holdings(self, file_id: int, generation: int) -> list[Holding]:
        """Every host's holding of ``generation`` of the file, most complete first, with each
        host's address and heartbeat. It reads a row a host: a receiver's poll reads a window
        of them (:meth:`exchange`)."""
        with self.db.read() as s:
            return [holding_of_row(r) for r in s.execute(most_complete(file_id, generation))]

    def leaders(
        self, file_id: int, generation: int, *, count: int, limit: int
    ) -> tuple[list[Holding], int]:
        """See :func:`tiering.catalog.tracker.leaders`."""
        with self.db.read() as s:
            return leaders(s, file_id, generation, count=count, limit=limit)

    def holding(self, file_id: int, host: str) -> Holding | None:
        """``host``'s holding of the file, whichever generation it is of."""
        with self.db.read() as s:
            h = s.get(PieceHolding, (file_id, host))
            return None if h is None else holding_of(h)

    def forget(self, file_id: int, *, host: str) -> None:
        """``host`` dropped its bytes of the file: it serves none of them any more."""
        q = delete(PieceHolding).where(PieceHolding.file_id == file_id, PieceHolding.host == host)
        self.db.transact(lambda s: s.execute(q), changes_files=False)

    def forget_host(self, host: str) -> int:
        """Delete every holding of ``host``; how many went."""
        q = delete(PieceHolding).where(PieceHolding.host == host)
        return self.db.transact(
            lambda s: int(s.execute(q).rowcount or 0),  # type: ignore[attr-defined]
            changes_files=False,
        )
