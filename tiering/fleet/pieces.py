"""Pieces of a file, as hosts of a fleet exchange them: split, digest, verify, and the choice of
which peer sends which piece. Pure logic; the catalog's rows are
:mod:`tiering.catalog.pieces`.

**Piece size: 8 MiB.** It is the object tier's ranged-GET part (S3 scales with many parallel
8–16 MB ranged GETs, and tierd's reads use 8 MiB parts), so a piece fetched from the bucket is
one GET and a piece from a peer one ranged request of the same size. Smaller pieces (Kraken's
4 MB) would double the requests and the digests for no gain on links of 1–100 Gbit/s; bigger
ones (Dragonfly goes to 64 MiB) would make a relay wait longer before it can pass a piece on,
and make a bad piece or a killed peer cost more to fetch again. A 70 GB model is ~8,400 pieces,
whose digests take 134 KB in one catalog row. The size is stored with each generation's map,
so it can change without reinterpreting an old map.

**Digest: xxh3-128** (the catalog's whole-file checksum's algorithm): 16 bytes a piece, and
tens of GB/s a core, so verifying every piece on arrival costs little beside the transfer.
It catches corruption and mistakes (a peer serving other bytes), not a malicious peer that
forges collisions; peers are trusted members of the fleet holding the fleet credential.

**Choosing sources.** Every missing piece goes to a peer that has verified it, preferring the
one that would deliver it soonest: its uploads in flight (already serving, plus what this plan
gave it) over its measured rate (:class:`Speeds`: what this host got from it lately; a peer not
measured yet counts as the median of those that were, so it is tried), then the most complete
(a host with all pieces is likely to stay a good source), then the host id (stable plans). A
peer at ``per_peer`` uploads gets nothing more; a peer that sent a bad piece is avoided for a
while (``failures.PeerFailures``). A piece no peer can give goes to the bucket (``None``).

**The bucket when it is faster.** A host that may read the bucket (it holds a claim) measures it
as it measures peers (:data:`BUCKET`, in the same :class:`Speeds`), and a piece goes to the
bucket when it would arrive from there sooner than from any peer that holds it: a bucket in the
same region with more bandwidth than the hosts' links is then used for what it does best, and a
slow one only for what no peer has. How many hosts read the bucket at once stays
``fleet_origin_readers``' to say.
"""

from __future__ import annotations

import os
import statistics
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import xxhash

from tiering.catalog.pieces import Holding, PieceDigests
from tiering.errors import IntegrityError

__all__ = [
    "ALGORITHM",
    "BUCKET",
    "PIECE_SIZE",
    "Avoids",
    "BadPiece",
    "Speeds",
    "digest",
    "digests_of_fd",
    "piece_count",
    "piece_span",
    "plan_sources",
    "spans",
    "verify",
]

PIECE_SIZE = 8 << 20
ALGORITHM = "xxh3_128"


class BadPiece(IntegrityError):
    """A piece's bytes do not match its digest (or its length)."""

    code = "bad_piece"

    def __init__(self, index: int, why: str) -> None:
        super().__init__(f"piece {index}: {why}", piece=index)
        self.index = index


def piece_count(size: int, piece_size: int = PIECE_SIZE) -> int:
    """Pieces of a file of ``size`` bytes: at least one (an empty file is one empty piece)."""
    if piece_size <= 0 or size < 0:
        raise ValueError("size must be >= 0 and piece_size > 0")
    return max(1, -(-size // piece_size))


def piece_span(index: int, size: int, piece_size: int = PIECE_SIZE) -> tuple[int, int]:
    """(offset, length) of piece ``index``."""
    if not 0 <= index < piece_count(size, piece_size):
        raise ValueError(f"piece {index} is outside a file of {size} bytes")
    offset = index * piece_size
    return offset, min(piece_size, size - offset)


def spans(size: int, piece_size: int = PIECE_SIZE) -> list[tuple[int, int]]:
    """Every piece's (offset, length), in order."""
    return [piece_span(i, size, piece_size) for i in range(piece_count(size, piece_size))]


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """One piece's digest (xxh3-128, 16 bytes)."""
    return xxhash.xxh3_128_digest(data)


def digests_of_fd(fd: int, size: int, piece_size: int = PIECE_SIZE) -> list[bytes]:
    """Every piece's digest of an open file's first ``size`` bytes (``pread``: the offset is
    untouched); :class:`BadPiece` if the file is shorter."""
    out = []
    for i, (offset, length) in enumerate(spans(size, piece_size)):
        h = xxhash.xxh3_128()
        done = 0
        while done < length:
            chunk = os.pread(fd, min(1 << 20, length - done), offset + done)
            if not chunk:
                raise BadPiece(i, f"the file ends at {offset + done} of {size} bytes")
            h.update(chunk)
            done += len(chunk)
        out.append(h.digest())
    return out


def verify(pieces: PieceDigests, index: int, data: bytes | bytearray | memoryview) -> None:
    """Check piece ``index``'s bytes against the map; :class:`BadPiece` if they differ."""
    if pieces.algorithm != ALGORITHM:
        raise BadPiece(index, f"cannot check {pieces.algorithm} digests")
    _, length = piece_span(index, pieces.size, pieces.piece_size)
    if len(data) != length:
        raise BadPiece(index, f"{len(data)} bytes, not {length}")
    if digest(data) != pieces.digests[index]:
        raise BadPiece(index, "its bytes do not match the recorded digest")


class Avoids(Protocol):
    """Which peers to skip for now (:class:`~tiering.fleet.failures.PeerFailures`)."""

    def avoided(self, host: str, now: float | None = None) -> bool: ...


#: The bucket's key in :class:`Speeds` (no host id is empty).
BUCKET = ""


class Speeds:
    """Each peer's delivery rate as this host measured it: bytes a second over its recent
    pieces (an exponentially weighted mean, so a peer that slows down, a busy or far one, is
    soon ranked by what it gives now). Thread-safe: a host's fills all share one."""

    def __init__(self, weight: float = 0.3) -> None:
        self.weight = weight
        self._rates: dict[str, float] = {}
        self._lock = threading.Lock()

    def record(self, host: str, nbytes: int, seconds: float) -> None:
        """``host`` delivered ``nbytes`` in ``seconds`` (one request, start to last byte)."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            old = self._rates.get(host)
            self._rates[host] = rate if old is None else old + self.weight * (rate - old)

    def rates(self) -> dict[str, float]:
        """Every measured peer's rate, bytes a second."""
        with self._lock:
            return dict(self._rates)


def plan_sources(
    missing: Iterable[int],
    holdings: Sequence[Holding],
    *,
    me: str,
    generation: int,
    now: float,
    busy: Mapping[str, int] | None = None,
    avoid: Avoids | None = None,
    per_peer: int | None = None,
    up: Iterable[str] | None = None,
    speed: Mapping[str, float] | None = None,
    bucket: int | None = None,
) -> dict[int, str | None]:
    """Which peer sends each ``missing`` piece (None: the bucket), from the peers'
    ``holdings`` of ``generation`` (see the module docstring), planned in the order given.

    ``busy`` is each peer's uploads in flight, ``per_peer`` the most any peer is given (its
    busy count included), ``up`` the peers alive now (None: every holder), ``avoid`` the
    peers to skip, ``speed`` each measured peer's rate (:meth:`Speeds.rates`). This host
    (``me``) and holdings of another generation are never sources. ``bucket``: this host may
    read the bucket, with that many reads of it in flight; a piece then goes to it when its
    measured rate (``speed``'s :data:`BUCKET`) would deliver it sooner than any peer.
    """
    alive = None if up is None else set(up)
    peers = [
        h
        for h in holdings
        if h.host != me
        and h.generation == generation
        and (alive is None or h.host in alive)
        and not (avoid is not None and avoid.avoided(h.host, now))
    ]
    load = {h.host: (busy or {}).get(h.host, 0) for h in peers}
    measured = {k: v for k, v in (speed or {}).items() if v > 0 and k != BUCKET}
    from_bucket = (speed or {}).get(BUCKET, 0.0) if bucket is not None else 0.0
    queued = bucket or 0
    usual = statistics.median(measured.values()) if measured else 1.0
    rate = {h.host: measured.get(h.host, usual) for h in peers}
    plan: dict[int, str | None] = {}
    for index in dict.fromkeys(missing):  # in the caller's order (a receiver's: rarest first)
        able = [h for h in peers if h.has(index) and (per_peer is None or load[h.host] < per_peer)]
        if not able:
            plan[index] = None
            continue
        # When it would arrive: the pieces ahead of it at that peer, one after another.
        best = min(able, key=lambda h: ((load[h.host] + 1) / rate[h.host], -h.pieces, h.host))
        if from_bucket > 0 and (queued + 1) / from_bucket < (load[best.host] + 1) / rate[best.host]:
            queued += 1
            plan[index] = None
            continue
        load[best.host] += 1
        plan[index] = best.host
    return plan
