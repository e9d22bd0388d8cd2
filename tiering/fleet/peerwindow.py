"""One fill's conversation with the tracker: the pieces it landed from peers, told a batch at a
time, and the window of its peers' holdings it plans from. A piece fill
(:mod:`tiering.copies.piecefill`) and ``tierd bench tracker``'s simulated hosts both talk
through this class, so the bench makes the calls the product makes.

Each :meth:`PeerWindow.poll` is one transaction (:meth:`~tiering.catalog.pieces.Pieces.exchange`):
it adds the pieces landed since the last poll to this host's holding and reads the next window
of peers (see :mod:`tiering.catalog.tracker`). A fill polls every
:data:`~tiering.copies.piecefill.POLL_S` while it has room for more fetches, so peers learn of
a piece at most about a poll later; the pieces landed while no poll runs are told by
:meth:`PeerWindow.flush`.

What a fill plans from (:meth:`PeerWindow.view`) is the last window, the claimers, and the
holders a read of every host's holding found (:meth:`PeerWindow.refresh` with ``wide``, before
the fill claims the bucket: a seed outside this host's windows must not send it to the
bucket). Holdings only grow while a generation lasts, so a view a little old is never wrong,
only short.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from tiering.catalog.pieces import WINDOW, Holding, Pieces

__all__ = ["WIDE_S", "PeerWindow", "alive"]

#: The least time between two reads of every host's holding (a read a row a host).
WIDE_S = 1.0


def alive(holdings: Iterable[Holding], me: str, now: float, timeout_s: float) -> dict[str, str]:
    """The hosts of ``holdings`` (other than ``me``) whose heartbeat, read with the holding, is
    at most ``timeout_s`` old, by id, with their URLs."""
    return {
        h.host: h.address
        for h in holdings
        if h.address is not None
        and h.heartbeat is not None
        and now - h.heartbeat <= timeout_s
        and h.host != me
    }


class PeerWindow:
    """``host``'s polls of the holdings of ``generation`` of file ``file_id``.

    Parameters
    ----------
    pieces
        The catalog's pieces.
    file_id, generation
        The file and generation being filled.
    host
        This host's id: its windows start after it, so hosts' windows are spread over the fleet.
    count
        The generation's pieces (set it once the map is read, before the first piece lands).
    window
        Peers' holdings a poll reads (besides the claimers').
    """

    def __init__(
        self,
        pieces: Pieces,
        file_id: int,
        generation: int,
        host: str,
        *,
        count: int = 0,
        window: int = WINDOW,
    ) -> None:
        self.pieces, self.file_id, self.generation, self.host = pieces, file_id, generation, host
        self.count, self.window = count, window
        self._after = host
        self._lock = threading.Lock()
        self._have = 0  # bit i: piece i verified here
        self._since = float("inf")  # monotonic time of the oldest piece not told yet
        self.read_at = float("-inf")
        self.wide_at = float("-inf")
        self._polled: list[Holding] = []
        self._pinned: dict[str, Holding] = {}

    def landed(self, indices: Iterable[int]) -> None:
        """Pieces verified and written here, to tell the catalog at the next poll or flush
        (with every piece landed before: a poll writes this host's whole holding)."""
        with self._lock:
            for i in indices:
                self._have |= 1 << i
            self._since = min(self._since, time.monotonic())

    def waiting_s(self) -> float:
        """How long the oldest piece not yet told has waited (0: none waits)."""
        with self._lock:
            return max(0.0, time.monotonic() - self._since)

    def _take(self) -> bytes | None:
        """The holding to write, or None when nothing landed since the last write."""
        with self._lock:
            if self._since == float("inf"):
                return None
            if self._have.bit_length() > self.count:
                raise ValueError(f"piece {self._have.bit_length() - 1} of {self.count} landed")
            self._since = float("inf")
            return self._have.to_bytes((self.count + 7) // 8, "little")

    def _untold(self) -> None:
        with self._lock:
            self._since = min(self._since, time.monotonic())

    def poll(self) -> list[Holding] | None:
        """Tell the pieces landed (if any landed since the last write) and read the next
        window of peers' holdings and the claimers'; None when the holding was refused (the
        file is gone or at another generation)."""
        have = self._take()
        try:
            ex = self.pieces.exchange(
                self.file_id,
                host=self.host,
                generation=self.generation,
                have=have,
                after=self._after,
                limit=self.window,
            )
        except BaseException:
            if have is not None:
                self._untold()  # told at the next poll, or by the fill's last flush
            raise
        if ex is None:
            return None
        self._after = ex.after
        return ex.holdings

    def flush(self) -> bool:
        """Tell every piece landed, if any landed since the last write; False when refused
        (see :meth:`poll`)."""
        have = self._take()
        if have is None:
            return True
        try:
            return self.pieces.tell(
                self.file_id, host=self.host, generation=self.generation, have=have
            )
        except BaseException:
            self._untold()
            raise

    def everyone(self) -> list[Holding]:
        """Every host's holding of the generation (a read of a row a host)."""
        return self.pieces.holdings(self.file_id, self.generation)

    def refresh(self, now: float, *, wide: bool, lacked: Callable[[], set[int]]) -> bool:
        """Poll (:meth:`poll`), or (``wide``) read every host's holding and keep in view the
        (at most a window of) most complete holders of pieces this host ``lacked``; False when
        a poll's pieces were refused."""
        if wide:
            missing = lacked()
            useful = [
                h
                for h in self.everyone()  # most complete first
                if h.host != self.host and any(h.has(i) for i in missing)
            ]
            self._pinned = {h.host: h for h in useful[: self.window]}
            self.wide_at = now
        else:
            polled = self.poll()
            if polled is None:
                return False
            self._polled = polled
        self.read_at = now
        return True

    def view(self) -> list[Holding]:
        """The holdings to plan from: the last poll's, and the holders the last wide read found
        (their rows as then, unless a poll read them since)."""
        return list(
            (
                {h.host: h for h in self._pinned.values()} | {h.host: h for h in self._polled}
            ).values()
        )
