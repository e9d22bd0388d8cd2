"""The catalog's pieces: each file generation's piece digests, and which host has verified
which pieces of it (see :class:`~tiering.catalog.models.PieceMap` and
:class:`~tiering.catalog.models.PieceHolding`).

The promises:

- a map is tied to one generation of one file, and is written only while the file is at that
  generation; the first host to record it wins, and a second recorder gets the first's map
  back (its own digests are of the same bytes, or it read something else and must not
  distribute it);
- recording a map deletes the maps and holdings of the file's other generations, so no host
  picks a source, or checks a piece, by an old generation's digests;
- a holding grows only while the file is at its generation; a holding of another generation
  is never returned as a source.

These writes change no file's place or content (``changes_files=False``).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from tiering.catalog.backends import FOR_KEY_SHARE
from tiering.catalog.db import Database
from tiering.catalog.models import FileRecord, PieceHolding, PieceMap

__all__ = ["Holding", "PieceDigests", "Pieces", "bitmap", "bits_of"]


def bitmap(indices: Iterable[int], count: int) -> bytes:
    """The bitmap of ``count`` pieces with ``indices`` set (bit ``i`` of byte ``i // 8``)."""
    out = bytearray((count + 7) // 8)
    for i in indices:
        if not 0 <= i < count:
            raise ValueError(f"piece {i} is outside 0..{count - 1}")
        out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def bits_of(have: bytes, count: int) -> list[int]:
    """The indices set in a bitmap of ``count`` pieces, in order."""
    return [i for i in range(count) if have[i // 8] >> (i % 8) & 1]


@dataclass(frozen=True)
class PieceDigests:
    """One generation's pieces: ``piece_size`` bytes each (the last shorter) and a digest each."""

    file_id: int
    generation: int
    size: int
    piece_size: int
    algorithm: str
    digests: tuple[bytes, ...]
    recorded_by: str
    created_at: float

    @property
    def count(self) -> int:
        return len(self.digests)


@dataclass(frozen=True)
class Holding:
    """What one host has verified of one generation: the pieces' bitmap and how many."""

    file_id: int
    host: str
    generation: int
    have: bytes
    pieces: int
    updated_at: float

    def has(self, index: int) -> bool:
        byte = index // 8
        return byte < len(self.have) and bool(self.have[byte] >> (index % 8) & 1)


def _digests(m: PieceMap) -> PieceDigests:
    width = _WIDTH.get(m.algorithm, 16)
    blob = bytes(m.digests)
    parts = tuple(blob[i : i + width] for i in range(0, len(blob), width))
    return PieceDigests(
        m.file_id, m.generation, m.size, m.piece_size, m.algorithm, parts, m.recorded_by,
        m.created_at,
    )  # fmt: skip


def _holding(h: PieceHolding) -> Holding:
    return Holding(h.file_id, h.host, h.generation, bytes(h.have), h.pieces, h.updated_at)


#: Bytes of one digest, by algorithm.
_WIDTH = {"xxh3_128": 16, "sha256": 32}


def _at(s: Session, file_id: int, generation: int, states: Collection[str] | None) -> bool:
    # KEY SHARE: a delete of the file waits for this transaction (and then cascades what it
    # wrote), while moves and access counts go on.
    rec = s.get(FileRecord, file_id, with_for_update=FOR_KEY_SHARE)
    return (
        rec is not None and rec.generation == generation and (states is None or rec.state in states)
    )


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
        width = _WIDTH.get(algorithm)
        if width is None:
            raise ValueError(f"unknown piece digest algorithm {algorithm!r}")
        if piece_size <= 0 or size < 0 or len(digests) != max(1, -(-size // piece_size)):
            raise ValueError(f"{len(digests)} digests do not cover {size} bytes by {piece_size}")
        if any(len(d) != width for d in digests):
            raise ValueError(f"{algorithm} digests are {width} bytes each")

        def body(s: Session) -> PieceDigests | None:
            if not _at(s, file_id, generation, states):
                return None
            s.execute(
                delete(PieceMap).where(
                    PieceMap.file_id == file_id, PieceMap.generation != generation
                )
            )
            s.execute(
                delete(PieceHolding).where(
                    PieceHolding.file_id == file_id, PieceHolding.generation != generation
                )
            )
            found = s.get(PieceMap, (file_id, generation))
            if found is None:
                found = PieceMap(
                    file_id=file_id,
                    generation=generation,
                    size=size,
                    piece_size=piece_size,
                    algorithm=algorithm,
                    digests=b"".join(digests),
                    recorded_by=host,
                    created_at=time.time() if now is None else now,
                )
                s.add(found)
                s.flush()
            return _digests(found)

        # Two hosts recording the first map at once: the loser finds the winner's on retry.
        return self.db.transact(body, changes_files=False, retry_unique=True)

    def map(self, file_id: int, generation: int) -> PieceDigests | None:
        """The digests of ``generation`` of the file, if recorded."""
        with self.db.read() as s:
            m = s.get(PieceMap, (file_id, generation))
            return None if m is None else _digests(m)

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

        def body(s: Session) -> Holding | None:
            if not _at(s, file_id, generation, None):
                return None
            m = s.get(PieceMap, (file_id, generation))
            if m is None:
                return None
            count = len(_digests(m).digests)
            new = bitmap(wanted, count)
            row = s.get(PieceHolding, (file_id, host), with_for_update=True)
            stamp = time.time() if now is None else now
            if row is None:
                row = PieceHolding(file_id=file_id, host=host, generation=generation)
                row.have = new
                s.add(row)
            else:
                old = bytes(row.have) if row.generation == generation else bytes(len(new))
                row.generation = generation
                old = old.ljust(len(new), b"\0")
                row.have = bytes(a | b for a, b in zip(old, new, strict=True))
            row.pieces = len(bits_of(row.have, count))
            row.updated_at = stamp
            s.flush()
            return _holding(row)

        return self.db.transact(body, changes_files=False, retry_unique=True)

    def holdings(self, file_id: int, generation: int) -> list[Holding]:
        """Every host's holding of ``generation`` of the file, most complete first."""
        q = (
            select(PieceHolding)
            .where(PieceHolding.file_id == file_id, PieceHolding.generation == generation)
            .order_by(PieceHolding.pieces.desc(), PieceHolding.host)
        )
        with self.db.read() as s:
            return [_holding(h) for h in s.scalars(q)]

    def holding(self, file_id: int, host: str) -> Holding | None:
        """``host``'s holding of the file, whichever generation it is of."""
        with self.db.read() as s:
            h = s.get(PieceHolding, (file_id, host))
            return None if h is None else _holding(h)

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
