"""One fill's conversation with the tracker: the pieces it landed from peers, told a batch at a
time, and the window of its peers' holdings it plans from. A piece fill
(:mod:`tiering.copies.piecefill`) and ``tierd bench tracker``'s simulated hosts both talk
through this class, so the bench makes the calls the product makes.

Each :meth:`PeerWindow.poll` is one transaction (:meth:`~tiering.catalog.pieces.Pieces.exchange`):
it adds the pieces landed since the last poll to this host's holding and reads the next window
of peers (see :mod:`tiering.catalog.tracker`). A fill polls every
:attr:`PeerWindow.interval` while it has room for more fetches, so peers learn of a piece at
most about a poll later; the pieces landed while no poll runs are told by
:meth:`PeerWindow.flush`.

How often is the fleet's to share: every :data:`POLL_S` in a fleet of up to a few hundred
hosts, less often in a bigger one, so that the hosts filling one generation ask the tracker
for at most :data:`POLLS_PER_S` polls a second together (BitTorrent's trackers tell their
peers an announce interval for the same reason). Measured on one PostgreSQL (``tierd bench
tracker``), a thousand hosts polling ten times a second asked for 10,000 polls a second; it
served a third of them, with a p99 of 127 ms. Each host counts the hosts still filling from the
holdings it reads (its windows walk the whole fleet), so no host has to be told the fleet's
size, and the interval shrinks again as hosts finish.

What a fill plans from (:meth:`PeerWindow.view`) is the last window, the claimers, and the
most complete holders a wide read found (:meth:`PeerWindow.refresh` with ``wide``, before
the fill claims the bucket: a seed outside this host's windows must not send it to the
bucket). Holdings only grow while a generation lasts, so a view a little old is never wrong,
only short.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from tiering.catalog.pieces import WINDOW, Holding, Pieces
from tiering.config import EngineConfig

__all__ = ["POLLS_PER_S", "POLL_S", "WIDE_S", "PeerWindow", "alive"]

#: How often a fill polls the tracker in a fleet small enough (see :data:`POLLS_PER_S`): one
#: transaction that tells the pieces it landed since the last poll and reads the next window
#: of its peers' holdings. A transaction a piece was one per piece per host (2 GB/s is 240
#: pieces a second a host); a poll is one per host per tenth of a second, whatever the link.
POLL_S = 0.1
#: The polls a second the hosts filling one generation ask of the tracker together, at most
#: (the ``fleet_tracker_polls`` setting): at 2,000 a second the tracker's p99 poll was 36-45 ms
#: with 1,000 hosts on the H200 host's PostgreSQL (50 ms wanted).
POLLS_PER_S = EngineConfig.tracker_polls
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
    polls_per_s
        The fleet's polls a second for this generation, at most (see :attr:`interval`).
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
        polls_per_s: float = POLLS_PER_S,
    ) -> None:
        if polls_per_s <= 0:
            raise ValueError(f"polls_per_s must be positive, got {polls_per_s}")
        self.pieces, self.file_id, self.generation, self.host = pieces, file_id, generation, host
        self.count, self.window, self.polls_per_s = count, window, polls_per_s
        self._filling = {host}  # the hosts seen still filling the generation (they poll)
        self._census = 0  # the hosts filling it, as a wide read counted them (until a lap)
        self._wrapped = False  # the windows passed the fleet's end since the census
        self._after = host
        self._lock = threading.Lock()
        self._have = 0  # bit i: piece i verified here
        self._since = float("inf")  # monotonic time of the oldest piece not told yet
        self.read_at = float("-inf")
        self.wide_at = float("-inf")
        self._polled: list[Holding] = []
        self._pinned: dict[str, Holding] = {}

    @property
    def interval(self) -> float:
        """Seconds between two polls: :data:`POLL_S`, or as long as keeps the hosts seen still
        filling under :attr:`polls_per_s` together."""
        return max(POLL_S, max(len(self._filling), self._census) / self.polls_per_s)

    def _saw(self, holdings: Iterable[Holding]) -> None:
        """Count the hosts still filling among ``holdings`` (a complete holding's host polls no
        more; a host not seen yet is counted when a window reaches it)."""
        for h in holdings:
            if self.count and h.pieces >= self.count and h.host != self.host:
                self._filling.discard(h.host)
            else:
                self._filling.add(h.host)

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
        self._lap(ex.after)
        self._after = ex.after
        self._saw(ex.holdings)
        return ex.holdings

    def _lap(self, after: str) -> None:
        """Once the windows have walked the whole fleet since a wide read's census, the hosts
        they saw still filling are the count: the census, never lowered as hosts finish, is
        dropped."""
        if after < self._after:
            self._wrapped = True
        if self._wrapped and after >= self.host:
            self._census, self._wrapped = 0, False

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

    def leaders(self) -> list[Holding]:
        """The most complete holdings of the generation, most complete first (at most four
        windows' worth), counting the hosts still filling it on the way."""
        holdings, self._census = self.pieces.leaders(
            self.file_id, self.generation, count=self.count, limit=4 * self.window
        )
        self._wrapped = False
        self._saw(holdings)
        return holdings

    def refresh(self, now: float, *, wide: bool, lacked: Callable[[], set[int]]) -> bool:
        """Poll (:meth:`poll`), or (``wide``) read the most complete holdings (:meth:`leaders`)
        and keep in view the (at most a window of) most complete holders of pieces this host
        ``lacked``; False when a poll's pieces were refused."""
        if wide:
            missing = lacked()
            useful = [
                h
                for h in self.leaders()  # most complete first
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
