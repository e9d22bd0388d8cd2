"""The values of the catalog's pieces, apart from the queries that read and write them
(:mod:`tiering.catalog.pieces`): one generation's piece digests (:class:`PieceDigests`), one
host's verified pieces of it (:class:`Holding`), and the bitmaps both are kept in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tiering.catalog.models import PieceHolding, PieceMap

__all__ = ["WIDTH", "Holding", "PieceDigests", "bitmap", "bits_of"]

#: Bytes of one digest, by algorithm.
WIDTH = {"xxh3_128": 16, "sha256": 32}


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
    known: bytes = b""  # bitmap of the digests recorded; b"" with ``final``: all of them
    final: bool = True

    @property
    def count(self) -> int:
        return len(self.digests)

    def has_digest(self, index: int) -> bool:
        """Whether piece ``index``'s digest is recorded (a receiver may check it)."""
        if self.final and not self.known:
            return 0 <= index < self.count
        byte = index // 8
        return byte < len(self.known) and bool(self.known[byte] >> (index % 8) & 1)


@dataclass(frozen=True)
class Holding:
    """What one host has verified of one generation: the pieces' bitmap and how many; where
    read with its host's row, that host's ``address`` and ``heartbeat`` (None: not read, or
    no such host)."""

    file_id: int
    host: str
    generation: int
    have: bytes
    pieces: int
    updated_at: float
    origin_until: float | None = None
    address: str | None = None
    heartbeat: float | None = None

    def has(self, index: int) -> bool:
        byte = index // 8
        return byte < len(self.have) and bool(self.have[byte] >> (index % 8) & 1)


def digests_of(m: PieceMap) -> PieceDigests:
    width = WIDTH.get(m.algorithm, 16)
    blob = bytes(m.digests)
    parts = tuple(blob[i : i + width] for i in range(0, len(blob), width))
    return PieceDigests(
        m.file_id,
        m.generation,
        m.size,
        m.piece_size,
        m.algorithm,
        parts,
        m.recorded_by,
        m.created_at,
        bytes(m.known),
        bool(m.final),
    )


def holding_of(h: PieceHolding) -> Holding:
    return Holding(
        h.file_id, h.host, h.generation, bytes(h.have), h.pieces, h.updated_at, h.origin_until
    )


def piece_count(size: int, piece_size: int) -> int:
    return max(1, -(-size // piece_size))
