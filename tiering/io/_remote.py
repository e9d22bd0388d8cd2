"""Remote files: loads of files that are not on a local disk (an object-store tier), without a
local copy first.

A :class:`RemoteFile` is a :class:`~tiering.io.GdsFile` over a tier's
:class:`~tiering.tiers.Source` instead of a descriptor: it has no fd, no backend handle and no
memory map, and every read goes through the source's :class:`~tiering.ranges.RangeReader`
(``Source.ranges``), the one interface of remote bytes (for an object, parallel ranged GETs
with ``If-Match`` on the ETag it was opened at, so a changed object raises
:class:`~tiering.errors.FileChanged` rather than mixing two versions). Nothing here knows
which store, protocol or client serves the bytes. The storage's one transfer primitive hands
every read of such a file to :class:`RemoteReads`:

- **into host memory** the bytes go straight into the destination, range by range
  (``ranges.readinto(dst[a:b], offset)``); ranges longer than a staging piece are split so
  that several run at once on the storage's ``remote`` pool, each fanning out further on the
  reader's own connections;
- **into GPU memory** they go through a ring of pinned staging pieces (a
  :class:`~tiering.io._backends.Staging` borrowed from a bounded pool): while piece ``i`` is
  copied to the device with ``cudaMemcpyAsync``, pieces ``i+1 .. i+k-1`` are being fetched, so
  the network never waits for the copy, nor the copy for more than one piece;
- **rows of a gather** are fetched by coalesced ranged reads of only the rows asked for (runs
  of nearby rows become one range while the bytes read in between stay below the bytes
  wanted), then put in request order in host memory; nothing is memory-mapped and the
  object is never downloaded whole.

Every read is counted under the I/O path ``remote`` and the file's tier. A file whose reader
serves a URL (an object) is read instead by KvikIO's ``RemoteFile`` where it is installed
(:class:`~tiering.ranges.KvikioReads`, :mod:`tiering.io._remote_kvikio`: libcurl on KvikIO's
C++ threads, straight into the destination, the version checked after the read), else over
tierd's own HTTP connections where the URL is plain ``http://``
(:class:`~tiering.ranges.HttpReads`, :mod:`tiering.io._remote_http`), as
``GdsConfig.remote_backend`` says;
:meth:`RemoteReads.read` gets the whole list of ranges of a call at once and asks once. The
report's ``engine`` says which one moved the bytes.

Kept whole past 450 lines: one remote file's read plan and the choice of its engine (auto's per-
origin judgement) share the plan's state.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import numpy as np

from tiering.errors import BackendUnavailable, IntegrityError, InvalidInput, StorageError
from tiering.ranges import (
    HttpRanges,
    HttpReads,
    HttpUnsupported,
    KvikioFailed,
    KvikioMode,
    KvikioRanges,
    KvikioReads,
    RangeReader,
    settle,
)
from tiering.tiers import Source

from ._backends import KVIKIO_HINT, StagingPool, _host_view
from ._config import GdsConfig
from ._decode_gpu import GpuDecoder, available
from ._device import Device, import_cupy
from ._file import GdsFile
from ._pools import Pools
from ._remote_http import Segment, Stagings, _split, read_if_fast
from ._remote_http import read_segments as read_by_http
from ._remote_kvikio import read_segments
from ._stats import IoReport, Stats

__all__ = ["Fill", "RemoteFile", "RemoteReads", "Segment", "coalesce_rows"]


Fill = Callable[[np.ndarray, np.ndarray], None]
"""``fill(idx, out)``: rows ``idx`` of a matrix file, in order, into host ``out`` (n x row)."""

log = logging.getLogger("tiering.io")

#: Gaps between wanted rows up to this many bytes are read through rather than split into
#: another request (a request costs a round trip; a connection moves ~1 MiB in that time).
GAP_BYTES = 256 << 10


class RemoteFile(GdsFile):
    """A file read through a tier's :class:`~tiering.tiers.Source` (no local descriptor), by
    its :class:`~tiering.ranges.RangeReader` ``ranges``.

    Made by :meth:`GpuDirectStorage.open_source <tiering.io.GpuDirectStorage.open_source>`; it
    owns the source and closes it when closed.
    """

    def __init__(
        self,
        source: Source,
        ranges: RangeReader,
        *,
        name: str,
        tier: str | None,
        rank: int | None,
        alignment: int,
        owner: object,
    ) -> None:
        super().__init__(
            Path(name),
            -1,
            source.size,
            tier=tier,
            rank=rank,
            alignment=alignment,
            handle=None,
            io_path="remote",
            owner=owner,
        )
        self.source = source
        self.ranges = ranges
        self._kvikio: KvikioRanges | None = None
        self._http: HttpRanges | None = None
        self._http_refused = False  # its URL is not one tierd's connections read
        self._readers_lock = threading.Lock()  # its KvikIO and HTTP readers, each made once

    def kvikio(self, reads: KvikioReads) -> KvikioRanges:
        """The file's reader through KvikIO (made at its first KvikIO read, kept until the
        file closes: one URL, presigned again only when half its lifetime has passed)."""
        with self._readers_lock:
            if self._kvikio is None:
                self._kvikio = reads.open(self.ranges)
            return self._kvikio

    def http(self, reads: HttpReads) -> HttpRanges | None:
        """The file's reader over tierd's own connections (made at its first such read, kept
        until the file closes), or None where its URL is not one they read."""
        with self._readers_lock:
            if self._http is None and not self._http_refused:
                try:
                    self._http = reads.open(self.ranges)
                except HttpUnsupported as exc:
                    self._http_refused = True
                    log.info(
                        "tiering.io: %s: read by URL without tierd's connections: %s",
                        self.path,
                        exc,
                    )
            return self._http

    def _rows(self, populate: bool) -> np.ndarray:
        raise InvalidInput(f"{self.path} is remote: it has no memory map")

    def _release(self) -> None:
        with self._readers_lock:
            if self._kvikio is not None:
                self._kvikio.close()
            self._kvikio = None
        self.source.close()

    def read_bytes(self, n: int, offset: int) -> bytes:
        buf = bytearray(max(0, min(n, self.size() - offset)))
        got = self.ranges.readinto(memoryview(buf), offset) if buf else 0
        return bytes(buf[:got])


def _read_exact(file: RemoteFile, view: memoryview, offset: int) -> None:
    got = file.ranges.readinto(view, offset)
    if got != len(view):
        raise IntegrityError(
            f"{file.path}: only {got} of {len(view)} bytes at offset {offset} could be read; "
            f"the range passes the end of the file ({file.size()} bytes when opened)",
            offset=offset,
        )


def coalesce_rows(
    rows: np.ndarray, row_bytes: int, gap_bytes: int = GAP_BYTES
) -> tuple[np.ndarray, np.ndarray]:
    """Ranges ``[first, end)`` of sorted unique ``rows`` that cover them with few requests.

    Neighbouring rows are merged into one range when the gap between them is at most
    ``gap_bytes``, smallest gaps first, while the bytes read in gaps stay below the bytes
    wanted: at most twice the wanted bytes are ever read.
    """
    if rows.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    gaps = np.diff(rows) - 1  # rows skipped between neighbours
    merge = np.zeros(gaps.size, dtype=bool)
    cand = np.flatnonzero(gaps * row_bytes <= gap_bytes)
    if cand.size:
        order = cand[np.argsort(gaps[cand], kind="stable")]
        spent = np.cumsum(gaps[order] * row_bytes)
        merge[order[spent <= rows.size * row_bytes]] = True
    breaks = np.flatnonzero(~merge) + 1
    first = rows[np.concatenate(([0], breaks))].astype(np.int64)
    last = rows[np.concatenate((breaks - 1, [rows.size - 1]))].astype(np.int64)
    return first, last + 1


class RemoteReads:
    """The reads of remote files for one storage (one device); see the module docstring."""

    def __init__(
        self,
        device: Device,
        config: GdsConfig,
        stats: Stats,
        pools: Pools,
        grow_pool: Callable[[int], None] | None = None,
    ) -> None:
        self._device = device
        mode = self._mode = config.remote_backend
        self._http = HttpReads(
            "auto" if mode in ("auto", "sockets") else "never",
            threads=config.remote_url_threads,
            task_size=config.remote_url_task_size,
            min_bytes=config.remote_url_min_bytes,
            expires_s=config.remote_url_expires_s,
        )
        # Pinned memory of these reads: two pieces of the task size a connection at most, as
        # one piece of a fast origin's GET (twice the task size) a connection.
        self._stagings = Stagings(2 * config.remote_url_task_size, config.remote_url_threads)
        kvikio: KvikioMode = "kvikio" if mode == "kvikio" else "auto"
        try:
            self._kvikio = KvikioReads(
                "never" if mode in ("python", "sockets") else kvikio,
                threads=config.remote_url_threads,
                task_size=config.remote_url_task_size,
                min_bytes=config.remote_url_min_bytes,
                expires_s=config.remote_url_expires_s,
                grow=grow_pool,
            )
        except ImportError as exc:  # asked for by name: refused when the storage is made
            raise BackendUnavailable(
                f"remote_backend='kvikio' needs KvikIO with remote I/O: {exc}; {KVIKIO_HINT}"
            ) from exc
        self._piece = config.remote_piece_size
        self._stats = stats
        self._pools = pools
        self._staging = StagingPool(
            config.remote_piece_size, config.remote_pieces, config.remote_stagings
        )
        self._gpu_decode = config.gpu_decode
        self._decoder: GpuDecoder | None = None
        self._decoder_lock = threading.Lock()

    def close(self) -> None:
        """Free the pinned staging kept for reuse, tierd's HTTP connections and the GPU
        decoder's buffers."""
        self._staging.clear()
        self._http.close()
        with self._decoder_lock:
            if self._decoder is not None:
                self._decoder.close()
            self._decoder = None

    def decoder(self) -> GpuDecoder | None:
        """The GPU decoder of compressed files (made at first need), or None where
        ``gpu_decode`` is off or nvCOMP is not installed (they are decoded on the host)."""
        if not self._gpu_decode or available() is not None:
            return None
        with self._decoder_lock:
            if self._decoder is None:
                self._decoder = GpuDecoder(self._device)
            return self._decoder

    def read(self, file: RemoteFile, dst: Any, segments: Sequence[Segment]) -> IoReport:
        """Read ``segments`` of ``file`` into flat uint8 ``dst``; counted as one operation."""
        nbytes = sum(n for _, n, _ in segments)
        source = file.ranges.source  # object_store, or peer: another host of the fleet
        started = self._stats.begin(file.io_path, file.tier_key, source)
        ok = False
        engine = "python"
        try:
            # The reads need this device current; the caller's thread gets its own back.
            with self._device.current():
                if nbytes and self._decoded_on_device(file, dst, segments):
                    engine = "nvcomp"
                elif nbytes:
                    engine = self._read_by_url_or_not(file, dst, segments)
            ok = True
        finally:
            seconds = self._stats.end(file.io_path, file.tier_key, started, nbytes, ok, source)
        return IoReport(nbytes, file.io_path, file.tier_key, seconds, engine=engine, source=source)

    def _read_by_url_or_not(self, file: RemoteFile, dst: Any, segments: Sequence[Segment]) -> str:
        """``segments`` by the first engine that applies (see ``GdsConfig.remote_backend``);
        the one that moved the most bytes."""
        left = self._fast_origin(file, dst, segments)
        if not left:
            return "sockets"
        if self._by_kvikio(file, dst, left, sum(n for _, n, _ in left)):
            return "kvikio"
        if self._by_http(file, dst, left):
            return "sockets"
        if isinstance(dst, np.ndarray):
            self._python_to_host(file, dst, left)
        else:
            self._to_device(file, dst, left)
        return "python"

    def _fast_origin(
        self, file: RemoteFile, dst: Any, segments: Sequence[Segment]
    ) -> Sequence[Segment]:
        """Under ``auto``, ``segments`` over tierd's own connections where the origin is a fast
        one (:func:`~tiering.io._remote_http.read_if_fast`); the segments still to read."""
        ranges = self._http_ranges(file, segments) if self._mode == "auto" else None
        if ranges is None:
            return segments
        return read_if_fast(ranges, dst, segments, device=self._device, stagings=self._stagings)

    def _http_ranges(self, file: RemoteFile, segments: Sequence[Segment]) -> HttpRanges | None:
        """``file`` over tierd's own connections, where they read a call of ``segments``."""
        if not self._http.wins(file.ranges, sum(n for _, n, _ in segments)):
            return None
        return file.http(self._http)

    def _decoded_on_device(self, file: RemoteFile, dst: Any, segments: Sequence[Segment]) -> bool:
        """A compressed file into device memory: its stored bytes moved and decoded there
        (:mod:`tiering.io._decode_gpu`); False where it is read as its logical bytes."""
        container = file.ranges.encoded
        if container is None or isinstance(dst, np.ndarray):
            return False
        decoder = self.decoder()
        if decoder is None:
            return False
        try:
            decoder.read(container, dst, segments)
        except IntegrityError:
            # Stored bytes that fail their digest: damage, unless the file was replaced
            # since it was opened (a read that could not be pinned saw the new bytes).
            file.ranges.check_unchanged()
            raise
        return True

    def _by_http(self, file: RemoteFile, dst: Any, segments: Sequence[Segment]) -> bool:
        """Read over tierd's own connections in GETs of the task size when they apply; False
        when another engine must (a range they fail to read is read through the tier's GETs,
        not here)."""
        ranges = self._http_ranges(file, segments)
        if ranges is None:
            return False
        size, lanes = self._http.plan(False)
        read_by_http(
            ranges,
            dst,
            _split(segments, size),
            lanes=lanes,
            device=self._device,
            stagings=self._stagings,
        )
        return True

    def _by_kvikio(
        self, file: RemoteFile, dst: Any, segments: Sequence[Segment], nbytes: int
    ) -> bool:
        """Read through KvikIO when it applies; False when the Python path must (or, after a
        failure of KvikIO under ``auto``, should) read instead. FileChanged propagates."""
        if not self._kvikio.wins(file.ranges, nbytes):
            return False
        if not isinstance(dst, np.ndarray):
            self._device.make_current()
        try:
            read_segments(file.path, file.kvikio(self._kvikio), dst, segments)
        except KvikioFailed as exc:
            if self._kvikio.strict:
                raise StorageError(
                    f"{file.path}: KvikIO remote read failed: {exc}", tier=file.tier_key
                ) from exc
            log.warning(
                "tiering.io: %s: KvikIO read failed (%s); reading again from Python", file.path, exc
            )
            return False
        return True

    def to_host(self, file: RemoteFile, dst: np.ndarray, segments: Sequence[Segment]) -> None:
        """Ranges straight into host array ``dst``, several at once (not counted)."""
        if sum(n for _, n, _ in segments):
            self._read_by_url_or_not(file, dst, segments)

    def _python_to_host(
        self, file: RemoteFile, dst: np.ndarray, segments: Sequence[Segment]
    ) -> None:
        view = _host_view(dst)
        parts = _split(segments, self._piece)
        if len(parts) == 1:
            off, n, at = parts[0]
            _read_exact(file, view[at : at + n], off)
            return
        pool = self._pools.aux("remote")
        settle([pool.submit(_read_exact, file, view[at : at + n], off) for off, n, at in parts])

    def _to_device(self, file: RemoteFile, dst: Any, segments: Sequence[Segment]) -> None:
        """Ranges into device array ``dst`` through a ring of pinned pieces."""
        cp = import_cupy()
        self._device.make_current()
        base = int(dst.data.ptr)
        pieces = _pack(_split(segments, self._piece), self._piece)
        pool = self._pools.aux("remote")
        st = self._staging.acquire(cp)
        slots = len(st.bufs)
        inflight: deque[list[Future[None]]] = deque()

        def fetch(i: int) -> None:
            slot = i % slots
            st.wait_slot(slot)  # the copy out of this slot (piece i - slots) has finished
            view = _host_view(st.views[slot])
            inflight.append(
                [
                    pool.submit(_read_exact, file, view[at : at + n], off)
                    for off, n, _dst, at in pieces[i]
                ]
            )

        try:
            for i in range(min(slots, len(pieces))):
                fetch(i)
            for i, piece in enumerate(pieces):
                settle(inflight.popleft())
                slot = i % slots
                for _off, n, dst_at, at in piece:
                    st.copy_out(cp, slot, base + dst_at, at, n)
                st.mark(cp, slot)
                if i + slots < len(pieces):
                    fetch(i + slots)
            st.drain()
        finally:
            # Nothing may still write into the staging, nor copy out of it, once it goes back.
            for futures in inflight:
                for f in futures:
                    f.cancel()
                wait(futures)
            st.drain()
            self._staging.release(st)

    def row_filler(self, file: RemoteFile, row_bytes: int) -> Fill:
        """A :data:`Fill` for gathers from ``file``: coalesced ranged reads of the rows asked
        for into a host scratch array, then the rows in request order."""

        def fill(idx: np.ndarray, out: np.ndarray) -> None:
            if idx.size == 0:
                return
            rows = np.unique(idx)
            first, end = coalesce_rows(rows, row_bytes)
            count = end - first
            at = np.concatenate(([0], np.cumsum(count)[:-1])).astype(np.int64)
            scratch = np.empty((int(count.sum()), row_bytes), dtype=np.uint8)
            self.to_host(
                file,
                scratch.reshape(-1),
                [
                    (int(f) * row_bytes, int(c) * row_bytes, int(a) * row_bytes)
                    for f, c, a in zip(first, count, at, strict=True)
                ],
            )
            k = np.searchsorted(first, idx, side="right") - 1
            np.take(scratch, at[k] + (idx - first[k]), axis=0, out=out)

        return fill


def _pack(parts: Sequence[Segment], piece: int) -> list[list[tuple[int, int, int, int]]]:
    """Group ``parts`` (each at most ``piece`` bytes) into staging pieces of at most ``piece``
    bytes: ``(file_offset, nbytes, dst_offset, offset_in_piece)`` each."""
    pieces: list[list[tuple[int, int, int, int]]] = []
    fill = piece
    for off, n, at in parts:
        if fill + n > piece:
            pieces.append([])
            fill = 0
        pieces[-1].append((off, n, at, fill))
        fill += n
    return pieces
