"""One record of what went wrong with each peer, and how long it is left alone for it.

A receiver (a fill of a host copy from pieces, or a load reading its peers) meets three kinds of
failure, each with a backoff of its own:

- **a bad piece** (its bytes do not match the piece map): the peer is avoided for
  :data:`AVOID_S`, doubled at each further bad piece up to :data:`AVOID_MAX_S`, as it may hold a
  damaged copy;
- **down** (refused, failing, cut short): skipped for :data:`PEER_RETRY_S`; what only it holds
  goes to the bucket meanwhile;
- **busy or not holding it yet** (429 ``peer_busy``, 404 ``not_held``: its catalog row ran
  ahead, or its copy is between publish and record): skipped for :data:`NOT_HELD_S`; a fill's
  pieces wait for it.

Piece fills and peer loads both keep one :class:`PeerFailures` and ask it alone whether a peer
may be asked now; it is thread-safe, so a loader's reads share one.
"""

from __future__ import annotations

import threading
import time

from tiering.fleet.peerfetch import NotHeld, PeerBusy, PeerFailed
from tiering.fleet.pieces import BadPiece

__all__ = ["AVOID_MAX_S", "AVOID_S", "NOT_HELD_S", "PEER_RETRY_S", "PeerFailures"]

#: Seconds a peer that sent a bad piece is avoided, doubled at each further bad piece.
AVOID_S = 60.0
AVOID_MAX_S = 600.0
#: Seconds a peer that failed (down, refused) is skipped before it is asked again.
PEER_RETRY_S = 1.0
#: Seconds a peer that is busy, or answered it does not hold a piece (yet), is skipped.
NOT_HELD_S = 0.2


class PeerFailures:
    """Each peer's failures and until when each keeps it from being asked (see the module
    docstring). Times are ``time.time()`` seconds; every method may be given ``now``."""

    def __init__(
        self,
        *,
        avoid_s: float = AVOID_S,
        avoid_max_s: float = AVOID_MAX_S,
        down_s: float = PEER_RETRY_S,
        busy_s: float = NOT_HELD_S,
    ) -> None:
        self.avoid_s, self.avoid_max_s = avoid_s, avoid_max_s
        self.down_s, self.busy_s = down_s, busy_s
        self._lock = threading.Lock()
        self._strikes: dict[str, int] = {}
        self._bad_until: dict[str, float] = {}
        self._down_until: dict[str, float] = {}
        self._busy_until: dict[str, float] = {}
        #: Bad pieces recorded, of every peer.
        self.bad_pieces = 0

    def bad_piece(self, host: str, now: float | None = None) -> float:
        """``host`` sent a bad piece: avoid it; returns until when."""
        now = time.time() if now is None else now
        with self._lock:
            strikes = self._strikes.get(host, 0) + 1
            self._strikes[host] = strikes
            self.bad_pieces += 1
            until = now + min(self.avoid_max_s, self.avoid_s * 2.0 ** (strikes - 1))
            self._bad_until[host] = until
            return until

    def down(self, host: str, now: float | None = None) -> float:
        """``host`` refused or failed: skip it for ``down_s``; returns until when."""
        return self._mark(self._down_until, host, self.down_s, now)

    def busy(self, host: str, now: float | None = None) -> float:
        """``host`` is busy or does not hold the piece yet: skip it for ``busy_s``."""
        return self._mark(self._busy_until, host, self.busy_s, now)

    def record(self, host: str, exc: BaseException, now: float | None = None) -> float:
        """Record ``exc`` from ``host`` as the kind of failure it is; returns until when the
        peer is left alone. Only a peer's failures are records: anything else is re-raised."""
        if isinstance(exc, BadPiece):
            return self.bad_piece(host, now)
        if isinstance(exc, NotHeld | PeerBusy):
            return self.busy(host, now)
        if isinstance(exc, PeerFailed):
            return self.down(host, now)
        raise exc

    def avoided(self, host: str, now: float | None = None) -> bool:
        """Whether ``host`` is avoided for a bad piece."""
        return self._until(self._bad_until, host, now)

    def is_down(self, host: str, now: float | None = None) -> bool:
        """Whether ``host`` failed within ``down_s``."""
        return self._until(self._down_until, host, now)

    def is_busy(self, host: str, now: float | None = None) -> bool:
        """Whether ``host`` was busy (or lacked the piece) within ``busy_s``."""
        return self._until(self._busy_until, host, now)

    def usable(self, host: str, now: float | None = None) -> bool:
        """Whether ``host`` may be asked now: neither avoided, nor down, nor busy."""
        now = time.time() if now is None else now
        return not (self.avoided(host, now) or self.is_down(host, now) or self.is_busy(host, now))

    def _mark(self, table: dict[str, float], host: str, wait_s: float, now: float | None) -> float:
        until = (time.time() if now is None else now) + wait_s
        with self._lock:
            table[host] = until
        return until

    def _until(self, table: dict[str, float], host: str, now: float | None) -> bool:
        now = time.time() if now is None else now
        with self._lock:
            return table.get(host, float("-inf")) > now
