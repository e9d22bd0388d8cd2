"""Loads from peers: a shared file this host lacks, read from another host's verified copy
over its ``GET /v1/peer/content`` (:class:`PeerRanges`, a :class:`~tiering.ranges.RangeReader`),
and the choice of those hosts (:class:`PeerReads`).

**Which peers, and when.** A peer is a source for a load when it is up (its heartbeat) and
holds the whole current generation verified: a copy in its memory tier or on its disk (the
copies table), or every piece of the generation (its piece holding). Memory copies come first,
then disk copies, then piece holdings; among equals each receiver takes its own stable order
(a hash of the two host ids), so receivers spread over the holders. Such a peer is taken
before the bucket, always: its bytes come over this host's own link from a copy in memory or
on NVMe, while the bucket's egress is one link for the whole fleet (the reason to distribute
at all), and a byte read from a peer is a byte the origin does not send. Measuring each
peer's rate against the bucket's would choose better on a fleet whose bucket is nearer than
its peers; nothing here needs it yet.

**Verified on arrival.** Where the catalog has the generation's piece map, every range is read
as whole pieces, each checked against its digest before a byte of it lands in the caller's
buffer (a range inside a piece fetches and checks the whole piece, then cuts; the last two
pieces are kept, so a load's neighbouring small ranges cost one fetch). Without a map (no
host has recorded one) the peer's bytes are those of its copy, which it checked against the
file's checksum when it filled it. So the reader serves no URL: KvikIO's ``RemoteFile`` would
read past the digests.

**Failover.** A peer that answers 404 ``not_held``, 401, anything unexpected, or not at all is
not asked again by this reader; one whose piece fails its digest is avoided by every reader
for a while (:class:`~tiering.fleet.failures.PeerFailures`). A 409 ``generation_mismatch`` means the
file changed: :class:`~tiering.errors.FileChanged`, never old bytes. When no peer is left,
the rest is read from the bucket (``fallback``), or, without one,
:class:`~tiering.fleet.peerfetch.PeerFailed` is raised.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tiering.catalog import Copies, FileRecord
from tiering.catalog.db import Database
from tiering.catalog.hosts import Hosts
from tiering.catalog.pieces import PieceDigests, Pieces
from tiering.errors import FileChanged
from tiering.fleet.failures import PeerFailures
from tiering.fleet.peerfetch import (
    PeerFailed,
    PeerHttp,
    StaleGeneration,
    fetch_piece,
    fetch_range,
)
from tiering.fleet.pieces import PIECE_SIZE, BadPiece, piece_span
from tiering.fleet.view import UP, locate
from tiering.ranges import RangeReader, flat
from tiering.tiers import Source, Stat

__all__ = ["PeerRanges", "PeerReads", "PeerSource"]

log = logging.getLogger(__name__)

#: Where a whole verified copy can be: a place of :func:`~tiering.fleet.view.locate`, warmest
#: first, then a complete piece holding.
_WARMTH = {"memory": 0, "copy": 1, "tier": 1, "pieces": 2}
#: Verified pieces a reader keeps, for ranges that share a piece.
_KEEP = 2


class PeerReads:
    """This host's reads of its peers' bytes: the credential, one HTTP client and pool of
    connections, the peers avoided for bad pieces, and what was received (for metrics).
    One per loader; thread-safe; :meth:`close` at the end. ``db()`` is the catalog's database
    (asked at each read: an engine opens its catalog after its loader is made)."""

    def __init__(
        self,
        db: Callable[[], Database],
        *,
        host_id: str,
        token: str,
        host_timeout_s: float,
        connections: int = 16,
    ) -> None:
        self.db = db
        self.host_id = host_id
        self.token = token
        self.host_timeout_s = host_timeout_s
        self.client = PeerHttp(timeout_s=60.0, connect_s=3.0, connections=connections)
        self.pool = ThreadPoolExecutor(connections, thread_name_prefix="tierd-peer")
        self._lock = threading.Lock()
        #: Every peer's failures (bad pieces, down, busy), shared by this host's peer loads.
        self.failures = PeerFailures()
        #: Bytes received from peers and checked (by digest where a map exists).
        self.bytes_received = 0

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()

    def sources(self, rec: FileRecord, digests: PieceDigests | None) -> list[tuple[str, str]]:
        """(host id, URL) of every up peer holding the whole of ``rec``'s generation (whose
        piece map is ``digests``, if recorded), in the order this host asks them (see the
        module docstring); none avoided now."""
        db = self.db()
        (located,) = locate(Hosts(db), Copies(db), [rec], timeout_s=self.host_timeout_s)
        up = {p.host_id: p.address for p in located.places if p.state == UP and p.address}
        best: dict[str, int] = {}
        for p in located.places:
            if p.kind in _WARMTH and p.host_id in up:
                best[p.host_id] = min(best.get(p.host_id, 9), _WARMTH[p.kind])
        if digests is not None:
            for h in Pieces(db).holdings(rec.id, rec.generation):
                if h.pieces == digests.count and h.host in up:
                    best.setdefault(h.host, _WARMTH["pieces"])
        now = time.time()
        hosts = [h for h in best if h != self.host_id and not self.failures.avoided(h, now)]
        hosts.sort(key=lambda h: (best[h], zlib.crc32(f"{self.host_id}/{h}".encode())))
        return [(h, up[h]) for h in hosts]

    def open(
        self, rec: FileRecord, fallback: Callable[[], Source] | None = None
    ) -> PeerRanges | None:
        """A reader of ``rec``'s generation from its peers, or None when no peer holds it.
        ``fallback`` opens the file on its bucket, for what no peer gives."""
        pieces = Pieces(self.db()).map(rec.id, rec.generation)
        if pieces is not None and not pieces.final:
            # A map still growing (a fill from the bucket is under way) lacks some digests: a
            # load reads whole copies only, trusting their whole-file checksum, until it is final.
            pieces = None
        peers = self.sources(rec, pieces)
        if not peers:
            return None
        return PeerRanges(self, rec, peers, pieces, fallback)

    @property
    def bad_pieces(self) -> int:
        """Pieces that failed their digest."""
        return self.failures.bad_pieces

    def received(self, nbytes: int) -> None:
        """Count ``nbytes`` received from a peer and checked (any thread)."""
        with self._lock:
            self.bytes_received += nbytes


class PeerRanges(RangeReader):
    """One generation of one shared file, read from ``peers`` in order (see the module
    docstring); ``pieces`` is the generation's piece map where one is recorded."""

    source = "peer"

    def __init__(
        self,
        reads: PeerReads,
        rec: FileRecord,
        peers: list[tuple[str, str]],
        pieces: PieceDigests | None,
        fallback: Callable[[], Source] | None,
    ) -> None:
        part = pieces.piece_size if pieces is not None else PIECE_SIZE
        version = str(rec.generation)
        super().__init__(rec.relpath, rec.size, version, pool=reads.pool, part_size=part)
        self.reads = reads
        self.generation = rec.generation
        self.pieces = pieces
        self.peers = list(peers)
        self._fallback = fallback
        self._bucket: Source | None = None
        self._kept: OrderedDict[int, bytes | bytearray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, view: memoryview, offset: int) -> None:
        view = flat(view)
        n = len(view)
        if n == 0:
            return
        if self.pieces is None:
            data = self._from_peers(
                lambda url: fetch_range(
                    self.reads.client,
                    url,
                    self.reads.token,
                    self.name,
                    self.generation,
                    offset,
                    n,
                )
            )
            if data is None:
                self._from_bucket(view, offset)
            else:
                view[:] = data
            return
        size, step = self.pieces.size, self.pieces.piece_size
        for index in range(offset // step, (offset + n - 1) // step + 1):
            at, length = piece_span(index, size, step)
            a, b = max(offset, at), min(offset + n, at + length)
            data = self._piece(index)
            if data is None:
                self._from_bucket(view[a - offset : b - offset], a)
            else:
                view[a - offset : b - offset] = data[a - at : b - at]

    def close(self) -> None:
        with self._lock:
            bucket, self._bucket = self._bucket, None
            self._kept.clear()
        if bucket is not None:
            bucket.close()

    # -- inside ------------------------------------------------------------------------------
    def _piece(self, index: int) -> bytes | bytearray | None:
        """Piece ``index``, verified: kept, or from the first peer that gives it."""
        with self._lock:
            kept = self._kept.get(index)
        if kept is not None:
            return kept
        pieces = self.pieces
        assert pieces is not None
        data = self._from_peers(
            lambda url: fetch_piece(
                self.reads.client, url, self.reads.token, self.name, pieces, index
            )
        )
        if data is not None:
            with self._lock:
                self._kept[index] = data
                while len(self._kept) > _KEEP:
                    self._kept.popitem(last=False)
        return data

    def _from_peers(self, fetch: Callable[[str], bytes | bytearray]) -> bytes | bytearray | None:
        """``fetch(url)`` of the first peer that answers with good bytes; None when none is
        left. A changed file raises :class:`~tiering.errors.FileChanged`."""
        failures = self.reads.failures
        for host, url in self.peers:
            if not failures.usable(host):
                continue
            try:
                data = fetch(url)
            except StaleGeneration as exc:
                raise FileChanged(
                    f"{self.name} changed since it was opened at generation {self.generation}: "
                    f"{exc.message}",
                    generation=exc.current,
                ) from exc
            except BadPiece as exc:
                log.warning(
                    "peer %s sent a bad piece of %s (%s): avoided a while",
                    host,
                    self.name,
                    exc.message,
                )
                failures.record(host, exc)
                continue
            except PeerFailed as exc:
                log.info("peer %s did not give %s: %s", host, self.name, exc.message)
                failures.record(host, exc)
                continue
            self.reads.received(len(data))
            return data
        return None

    def _from_bucket(self, view: memoryview, offset: int) -> None:
        """The bytes no peer gave, from the bucket (pinned to the version the catalog has)."""
        if self._fallback is None:
            raise PeerFailed(f"no peer could give {self.name} at generation {self.generation}")
        with self._lock:
            if self._bucket is None:
                self._bucket = self._fallback()
            bucket = self._bucket.ranges
        if bucket is None:
            raise PeerFailed(f"{self.name}: its tier reads no ranges")
        bucket.get(view, offset)


class PeerSource(Source):
    """``ranges``' bytes as a tier's :class:`~tiering.tiers.Source`, for the data path (which
    opens any source with a reader as a remote file). It owns ``ranges``."""

    def __init__(self, rec: FileRecord, ranges: PeerRanges) -> None:
        self.relpath = rec.relpath
        # The catalog's ETag: the bytes are its generation's (each request names it, every
        # piece or the whole copy checked), so a copy made from them is a copy of that object.
        self.stat = Stat(
            size=rec.size, mtime_ns=rec.mtime_ns, version=ranges.version, etag=rec.etag
        )
        self._ranges = ranges

    @property
    def ranges(self) -> PeerRanges:
        return self._ranges

    def readinto(self, buf: memoryview, offset: int) -> int:
        return self._ranges.readinto(buf, offset)

    def unchanged(self) -> bool:
        # Every request names the generation, and a peer refuses another one (409): the bytes
        # read are always the generation opened.
        return True

    def close(self) -> None:
        self._ranges.close()
