"""A host copy filled from pieces: several sources at once, every piece checked before it is
written, the bucket read about once per fleet.

A fill of a shared file's copy (a fleet prefetch, the copy planner) on a fleet with a credential
(:class:`FleetFills`) takes the file's 8 MiB pieces (:mod:`tiering.fleet.pieces`) from:

- peers holding verified pieces of the generation (the catalog's holdings, a window of peers at
  a time and every claimer's: :mod:`~tiering.fleet.peerwindow`; a peer still filling serves
  the pieces it verified so far, so hosts relay to each other as a chain or tree), chosen
  soonest to deliver first (pieces in flight there over its measured rate), then most
  complete, at most :attr:`FleetFills.per_peer` pieces in flight to
  one peer from this host;
- the bucket, only for pieces no live peer can give, and only while this host holds one of the
  at most K claims on reading the generation from the bucket
  (:meth:`~tiering.catalog.pieces.Pieces.claim_origin`). A host without a claim waits for the
  pieces no peer has yet while a live claimer (its claim renewed as its pieces land, its
  heartbeat fresh) makes progress; once no live claimer is left, it claims the bucket itself.

A piece from a peer is checked against the map's digest before it is written; a bad one is
dropped, fetched elsewhere, and the peer avoided a while; a peer that fails (killed, refused)
is skipped for a second, one busy or without the piece yet for a fifth of one (one record of
each peer's failures: :class:`~tiering.fleet.failures.PeerFailures`), and only the pieces still
missing are fetched again. A piece read from the bucket (at the ETag of the
record's generation) records its digest in the map as it lands, unless the map has one, which
it must then match. Each piece is written at its offset into the copy writer's temp
(:meth:`~tiering.tiers.Writer.write_at`), and marked held in the catalog once written, so others
take it from here while the fill runs. The whole-file checksum still ends the fill, in the
writer's publish; a mismatch drops the unfinished map (its digests came from those bytes).

A generation change anywhere (a peer's 409, the map gone, the catalog refusing a mark) ends
the fill with :class:`~tiering.errors.FileChanged`: nothing of the old bytes is kept or served.

Kept whole past 450 lines: one fill's state (its flight, map, holdings, the relay of what it
verified, the batch of landings not yet in the catalog) is shared by every step of it.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from tiering.catalog import FileRecord
from tiering.catalog.db import Database
from tiering.catalog.hosts import Hosts
from tiering.catalog.pieces import Holding, PieceDigests, Pieces
from tiering.config import EngineConfig
from tiering.errors import FileChanged, IntegrityError
from tiering.fleet.failures import PeerFailures
from tiering.fleet.peerfetch import (
    PeerFailed,
    PeerHttp,
    StaleGeneration,
    fetch_piece,
)
from tiering.fleet.peerwindow import POLLS_PER_S, WIDE_S, PeerWindow
from tiering.fleet.peerwindow import alive as peer_hosts
from tiering.fleet.pieces import (
    ALGORITHM,
    BUCKET,
    PIECE_SIZE,
    BadPiece,
    Speeds,
    digest,
    piece_span,
    plan_sources,
)
from tiering.tiers import FillCancelled, Source, Writer

__all__ = ["FleetFills", "PieceFill"]

log = logging.getLogger(__name__)

#: Bucket reads one fill has in flight: pieces land one after another, so relays start early
#: (a capped origin sends no faster for more of them).
ORIGIN_READS = 2
#: Pieces landed while the fill does not poll (every fetch slot busy) are told on their own once
#: the oldest waited two polls (:attr:`~tiering.fleet.peerwindow.PeerWindow.interval`): a poll,
#: when one comes, carries them.
MARK_POLLS = 2


@dataclass
class _Flight:
    """One fill's fetches: the pieces still missing, those in flight (to a peer, or None: the
    bucket), where they run, and the record of the peers' failures."""

    missing: set[int]
    pool: ThreadPoolExecutor
    http: PeerHttp
    inflight: dict[Future[None], tuple[int, str | None]] = field(default_factory=dict)
    failures: PeerFailures = field(default_factory=PeerFailures)

    def room(self, workers: int) -> int:
        return workers - len(self.inflight)


@dataclass(frozen=True)
class FleetFills:
    """What a fill from pieces needs: the catalog's pieces and hosts, this host's id and the
    fleet credential, ``origin_readers`` (K, the most hosts reading one generation from the
    bucket at once), ``tracker_polls`` (the fleet's polls a second of one generation, at most),
    ``origin_ttl_s`` (how long a claim holds unrenewed), ``host_timeout_s``
    (heartbeat age past which a peer is down), ``workers`` (pieces in flight) and
    ``per_peer`` (the most of them on one peer); ``speeds``, what this host measured each peer
    deliver, shared by its fills."""

    pieces: Pieces
    hosts: Hosts
    host: str
    token: str
    origin_readers: int = 1
    tracker_polls: float = POLLS_PER_S
    origin_ttl_s: float = 10.0
    host_timeout_s: float = 30.0
    workers: int = 8
    per_peer: int = 4
    speeds: Speeds = field(default_factory=Speeds, compare=False)

    @classmethod
    def of(cls, db: Database, host: str, config: EngineConfig) -> FleetFills | None:
        """A host's fills from pieces, given a fleet credential (None without one)."""
        if not config.fleet_token:
            return None
        return cls(
            Pieces(db),
            Hosts(db),
            host,
            config.fleet_token,
            origin_readers=config.origin_readers,
            tracker_polls=config.tracker_polls,
            host_timeout_s=config.host_timeout_s,
        )


class PieceFill:
    """One fill of ``rec``'s copy into ``writer``; :meth:`run` it once. :meth:`read_range`
    serves the verified pieces to peers while it runs (until :meth:`close`)."""

    def __init__(
        self,
        fleet: FleetFills,
        rec: FileRecord,
        writer: Writer,
        open_origin: Callable[[], Source],
        *,
        stop: Callable[[], bool],
        throttle: Callable[[int], None] | None = None,
        progress: Callable[[int], None] | None = None,
        sources: Callable[[str, int], None] | None = None,
    ) -> None:
        self.fleet, self.rec, self.writer = fleet, rec, writer
        self.generation = rec.generation
        self._open_origin = open_origin
        self._stop, self._throttle, self._progress = stop, throttle, progress
        self._sources = sources
        self._cond = threading.Condition()
        self._verified: set[int] = set()
        self._readers = 0
        self._closed = False
        self._origin: Source | None = None
        self._origin_lock = threading.Lock()
        self.claimed = False
        self.by_source: Counter[str] = Counter()
        self.map: PieceDigests | None = None
        self._window = PeerWindow(
            fleet.pieces, rec.id, rec.generation, fleet.host, polls_per_s=fleet.tracker_polls
        )

    # -- relay ---------------------------------------------------------------------------------
    def read_range(self, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` when every piece they touch is verified and written, else
        None (the fill ended, or the pieces are not here yet)."""
        m = self.map
        if m is None or not 0 <= start < end <= m.size:
            return None
        first, last = start // m.piece_size, (end - 1) // m.piece_size
        with self._cond:
            if self._closed or not all(i in self._verified for i in range(first, last + 1)):
                return None
            self._readers += 1
        try:
            return self.writer.read_at(start, end - start)
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """Serve no more (before the writer publishes or aborts): waits for reads in flight."""
        with self._cond:
            self._closed = True
            while self._readers:
                self._cond.wait()
        if self._origin is not None:
            self._origin.close()

    # -- the fill ------------------------------------------------------------------------------
    def run(self) -> None:
        """Fetch every piece into the writer (see the module docstring)."""
        f, rec = self.fleet, self.rec
        m = f.pieces.map(rec.id, self.generation) or f.pieces.open_map(
            rec.id,
            generation=self.generation,
            size=rec.size,
            piece_size=PIECE_SIZE,
            algorithm=ALGORITHM,
            host=f.host,
        )
        if m is None or m.size != rec.size:
            raise FileChanged(f"{rec.relpath!r} changed before it was copied")
        self.map = m
        self._window.count = m.count
        with (
            PeerHttp(timeout_s=30.0, connect_s=5.0, connections=f.workers) as http,
            ThreadPoolExecutor(f.workers, thread_name_prefix="tierd-piece") as pool,
        ):
            fl = _Flight(set(range(m.count)), pool, http)
            try:
                while fl.missing:
                    if self._stop():
                        raise FillCancelled
                    self._schedule(fl)
                    if not fl.inflight:
                        time.sleep(self._window.interval)
                        continue
                    done, _ = wait(list(fl.inflight), timeout=0.5, return_when=FIRST_COMPLETED)
                    for fut in done:
                        self._settle(fl, fut)
                    self._mark(due_only=True)
                self._mark()
            finally:
                for fut in fl.inflight:
                    fut.cancel()
                wait(list(fl.inflight))

    def _schedule(self, fl: _Flight) -> None:
        """Start fetches for as many missing pieces as there is room for: each from the peer
        :func:`~tiering.fleet.pieces.plan_sources` chooses, or from the bucket while this host
        holds a claim on it. A host without one, when no live claimer is left, first reads every
        host's holding (a peer outside its windows may hold the piece), then claims the bucket;
        after either, the plan is made again from the catalog as it is then."""
        wide = fresh = False
        while fl.room(self.fleet.workers) > 0:
            now = time.time()
            m, holdings = self._catalog(now, fresh=fresh, wide=wide)
            alive = peer_hosts(holdings, self.fleet.host, now, self.fleet.host_timeout_s)
            up = [h for h in alive if not fl.failures.is_down(h, now)]
            plan = self._plan(fl, m, holdings, up, now)
            # A claimer this host found down (its connections refused or failing) no longer
            # counts, whatever its heartbeat and claim still say: waiting them out cost a
            # distribution ~10 s when the killed peer was the one reading the bucket.
            claimers = [
                h.host
                for h in holdings
                if h.host != self.fleet.host and (h.origin_until or 0) > now and h.host in up
            ]
            able = [
                h
                for h in holdings
                if h.host in up
                and h.host != self.fleet.host
                and not fl.failures.avoided(h.host, now)
            ]
            if not self._start(fl, m, plan, holdings, able, alive):
                return
            if fresh or len(claimers) >= self.fleet.origin_readers:
                return  # claimed already, or a live claimer reads the pieces: wait for them
            if not wide and now - self._window.wide_at >= WIDE_S:
                wide = True  # plan again from every host's holding before claiming
                continue
            if not self._claim(claimers, now):
                return
            fresh = True  # claimed: pieces a claimer that just finished released may be on peers

    def _plan(
        self,
        fl: _Flight,
        m: PieceDigests,
        holdings: list[Holding],
        up: list[str],
        now: float,
    ) -> dict[int, str | None]:
        """The source of each missing piece not in flight (None: the bucket)."""
        taken = {i for i, _ in fl.inflight.values()}
        todo = [i for i in self._order(fl.missing - taken, holdings) if m.has_digest(i)]
        plan = plan_sources(
            todo,
            holdings,
            me=self.fleet.host,
            generation=self.generation,
            now=now,
            busy=Counter(p for _, p in fl.inflight.values() if p is not None),
            avoid=fl.failures,
            per_peer=self.fleet.per_peer,
            up=[h for h in up if not fl.failures.is_busy(h, now)],
            speed=self.fleet.speeds.rates(),
            bucket=sum(1 for _, p in fl.inflight.values() if p is None) if self.claimed else None,
        )
        plan.update({i: None for i in sorted(fl.missing - taken) if not m.has_digest(i)})
        return plan

    def _start(
        self,
        fl: _Flight,
        m: PieceDigests,
        plan: dict[int, str | None],
        holdings: list[Holding],
        able: list[Holding],
        alive: dict[str, str],
    ) -> bool:
        """Submit the planned fetches, rarest first, while there is room; False when a piece
        for the bucket waits for a claim this host does not hold (take one, then plan again)."""
        bucket = sum(1 for _, p in fl.inflight.values() if p is None)
        for index in self._order(set(plan), holdings):
            if fl.room(self.fleet.workers) <= 0:
                break
            peer = plan[index]
            if peer is None and m.has_digest(index) and any(h.has(index) for h in able):
                continue  # its holders are busy: wait for one rather than read the bucket
            if peer is None:
                if not self.claimed:
                    return True
                if bucket >= ORIGIN_READS:
                    continue
                bucket += 1
                fut = fl.pool.submit(self._from_origin, index)
            else:
                fut = fl.pool.submit(self._from_peer, fl.http, peer, alive[peer], index)
            fl.inflight[fut] = (index, peer)
        return False

    def _catalog(
        self, now: float, *, fresh: bool = False, wide: bool = False
    ) -> tuple[PieceDigests, list[Holding]]:
        """The generation's map and the holdings in view (:meth:`PeerWindow.view
        <tiering.fleet.peerwindow.PeerWindow.view>`), polled at most every
        :attr:`~tiering.fleet.peerwindow.PeerWindow.interval` (or when ``fresh``), or every
        host's read (``wide``). A fill schedules its next piece as
        each one lands, and 32 fills on 8 hosts asking the catalog at each landing kept two
        cores busy with queries whose answer had barely changed. Holdings only grow while a
        generation lasts, and a peer that lost a piece answers ``not_held``, so a tenth of a
        second's lag costs nothing but that lag."""
        w = self._window
        if fresh or wide or self.map is None or now - w.read_at >= w.interval:
            rec, pieces = self.rec, self.fleet.pieces
            if self.map is None or not self.map.final:
                m = pieces.map(rec.id, self.generation)
                if m is None:
                    raise FileChanged(
                        f"{rec.relpath!r} changed while it was copied (its map is gone)"
                    )
                self.map = m
            # A final map does not change while its generation lasts (tracker load: every
            # receiver read every digest ten times a second). A new generation is found by
            # the next poll that tells pieces, or by a peer's 409.
            if not w.refresh(now, wide=wide, lacked=self._lacked):
                raise FileChanged(f"{rec.relpath!r} changed while it was copied")
        return self.map, w.view()

    def _lacked(self) -> set[int]:
        with self._cond:
            return set(range(self.map.count if self.map else 0)) - self._verified

    def _order(self, indices: set[int], holdings: list[Holding]) -> list[int]:
        """Rarest first (fewest holders), ties in an order of this host's own, so receivers
        take different pieces first and then swap them (BitTorrent's rarest first)."""
        me = self.fleet.host

        def key(i: int) -> tuple[int, int]:
            holders = sum(1 for h in holdings if h.host != me and h.has(i))
            return holders, zlib.crc32(f"{me}:{i}".encode())

        return sorted(indices, key=key)

    def _claim(self, claimers: list[str], now: float) -> bool:
        """Take a claim on reading the bucket when fewer than K live hosts hold one; whether
        this host holds one now."""
        f = self.fleet
        if len(claimers) < f.origin_readers:
            self.claimed = f.pieces.claim_origin(
                self.rec.id,
                host=f.host,
                generation=self.generation,
                readers=f.origin_readers,
                ttl_s=f.origin_ttl_s,
                now=now,
            )
            log.debug("fill of %r: bucket claimed: %s", self.rec.relpath, self.claimed)
        return self.claimed

    def _settle(self, fl: _Flight, fut: Future[None]) -> None:
        """One fetch ended: its piece is no longer missing, or its peer's failure is recorded
        (its piece is fetched again, elsewhere or later)."""
        index, peer = fl.inflight.pop(fut)
        try:
            fut.result()
        except StaleGeneration as exc:
            raise FileChanged(
                f"{self.rec.relpath!r} changed while it was copied (generation {exc.current})"
            ) from exc
        except (BadPiece, PeerFailed) as exc:
            if peer is None:
                raise
            fl.failures.record(peer, exc)  # a bad piece is dropped: fetched again elsewhere
            return
        fl.missing.discard(index)

    def _mark(self, *, due_only: bool = False) -> None:
        """Tell the catalog the pieces landed from peers and not told by a poll yet: all of
        them, or (``due_only``) only once the oldest waited :data:`MARK_POLLS` polls."""
        if due_only and self._window.waiting_s() < MARK_POLLS * self._window.interval:
            return
        if not self._window.flush():
            raise FileChanged(f"{self.rec.relpath!r} changed while it was copied")

    # -- one piece -----------------------------------------------------------------------------
    def _from_peer(self, http: PeerHttp, peer: str, url: str, index: int) -> None:
        m = self.map
        assert m is not None
        t0 = time.perf_counter()
        data = fetch_piece(http, url, self.fleet.token, self.rec.relpath, m, index)
        self.fleet.speeds.record(peer, len(data), time.perf_counter() - t0)
        self._land(index, data, f"peer:{peer}", None)

    def _from_origin(self, index: int) -> None:
        m = self.map
        assert m is not None
        offset, length = piece_span(index, m.size, m.piece_size)
        with self._origin_lock:
            if self._origin is None:
                self._origin = self._open_origin()
            src = self._origin
        buf = bytearray(length)
        t0 = time.perf_counter()
        got = src.readinto(memoryview(buf), offset) if length else 0
        self.fleet.speeds.record(BUCKET, got, time.perf_counter() - t0)
        if got != length:
            raise FileChanged(f"{self.rec.relpath!r} ended at {offset + got}, not {m.size}")
        d = digest(buf)
        if m.has_digest(index) and m.digests[index] != d:
            raise IntegrityError(
                f"piece {index} of {self.rec.relpath!r} read from its origin does not match "
                "the digest recorded for its generation",
                file_id=self.rec.id,
                piece=index,
            )
        self._land(index, buf, "bucket", d)

    def _land(self, index: int, data: bytes | bytearray, source: str, d: bytes | None) -> None:
        if self._throttle is not None:
            self._throttle(len(data))
        m = self.map
        assert m is not None
        offset, _ = piece_span(index, m.size, m.piece_size)
        if data:
            self.writer.write_at(offset, memoryview(data))
        with self._cond:  # servable here before the catalog tells anyone it is
            self._verified.add(index)
        f = self.fleet
        # Told to the catalog by the next poll (PeerWindow.interval), which writes the holding.
        self._window.landed([index])
        if d is not None:  # from the bucket: its digest goes into the map now, for every receiver
            after = f.pieces.land(
                self.rec.id,
                host=f.host,
                generation=self.generation,
                index=index,
                digest=d,
                origin_ttl_s=f.origin_ttl_s,
            )
            if after is None:
                raise FileChanged(f"{self.rec.relpath!r} changed while it was copied")
        with self._cond:
            self.by_source[source] += len(data)
        if self._sources is not None:
            self._sources(source, len(data))
        if self._progress is not None:
            self._progress(len(data))
