"""The one transfer primitive: a byte range of an open file into a flat ``uint8`` array.

Every read of a storage (whole files, ranges, contiguous rows, safetensors shards) ends in
:meth:`Transfer.transfer`, which picks how to move the bytes by their size and temperature:

- hot GPU loads above ``_INLINE_MAX`` go through KvikIO's C++ thread pool, in one call;
- small reads into GPU memory that do not take the direct path are one ``pread`` and one copy;
- up to a task size (or with one thread) the read is issued inline, chunk after chunk;
- anything larger is split at task-size boundaries over the tier's thread pool.

Each transfer is counted once in the stats, under the file's I/O path and tier. A remote file
(:class:`~tiering.io._remote.RemoteFile`: no descriptor, an object-store tier's source) takes
none of these ways: its reads go to :class:`~tiering.io._remote.RemoteReads` whole. Nor does
a copy held in memory (:class:`~tiering.io._copies.CopyFile`): one memcpy moves it.

Each report says where its bytes came from: ``page_cache`` or ``storage`` for a local file
(reads above 1 MiB look at the page cache first; smaller ones count as ``page_cache``, as
the probe would cost as much as the read), ``object_store`` for a remote one, and the copy's
own source for a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from . import pagecache
from ._backends import SMALL_READ, Backend
from ._config import GdsConfig, TierIo
from ._copies import CopyFile, copy_into
from ._device import Device
from ._file import GdsFile
from ._pools import Pools
from ._remote import RemoteFile, RemoteReads, Segment
from ._stats import IoReport, LoadSource, Stats
from .fences import Fence

__all__ = ["Transfer", "merge_reports"]

# Below this size a read skips the page-cache probe and the thread pool: 4 KiB reads are
# latency-bound and a mincore() or a thread hop costs more than the read itself.
_INLINE_MAX = 1 << 20
_PROBE_MIN = 64 << 20


class Transfer:
    """Moves bytes from files into one device's memory with one backend.

    It owns no threads: the per-tier pools come from ``pools``, and it counts into ``stats``.
    """

    def __init__(
        self, device: Device, config: GdsConfig, backend: Backend, stats: Stats, pools: Pools
    ) -> None:
        self._device = device
        self._config = config
        self._backend = backend
        self._stats = stats
        self._pools = pools
        self.remote = RemoteReads(
            device, config, stats, pools, getattr(backend, "ensure_pool", None)
        )
        # Hot GPU loads go through KvikIO's C++ thread pool (see KvikioBackend.read_pooled);
        # cold ones through tierd's threads with cold_io's few large requests.
        self._pooled = device.is_cuda and hasattr(backend, "read_pooled")
        if self._pooled:
            # One pool for every device: GPUs loading at once share the tier's threads. More
            # threads measured no faster there (the page-cache copy is the ceiling: 49 GB/s
            # on all 32 cores of the 2×H200 host, one GPU alone takes 47 with 16 threads) and
            # slowed one GPU's loads afterwards (a 4-shard checkpoint: 0.115 s against 0.091).
            hot = [config.fast_tier_io, config.slow_tier_io, *config.tier_io.values()]
            backend.ensure_pool(max(io.threads for io in hot))  # type: ignore[attr-defined]

    def close(self) -> None:
        self.remote.close()

    def transfer(
        self,
        file: GdsFile,
        fd: int,
        dst: Any,
        dst_offset: int,
        file_offset: int,
        nbytes: int,
        fence: Fence | None = None,
    ) -> IoReport:
        """Read ``nbytes`` at ``file_offset`` into flat uint8 ``dst[dst_offset:]``; a copy
        held in memory may leave its wait to ``fence`` (see :mod:`tiering.io.fences`)."""
        if isinstance(file, RemoteFile):
            return self.remote.read(file, dst, [(file_offset, nbytes, dst_offset)])
        if isinstance(file, CopyFile):
            return copy_into(
                file, self._device, dst, dst_offset, file_offset, nbytes, self._stats, fence
            )
        io = self._config.io_for(file.tier, file.rank)
        cold = False
        if nbytes > _INLINE_MAX:
            cold = pagecache.residency(fd, file_offset, nbytes) < self._config.cold_threshold
            if cold and nbytes >= _PROBE_MIN:
                io = self._config.cold_io
        source: LoadSource = "storage" if cold else "page_cache"
        started = self._stats.begin(file.io_path, file.tier_key, source)
        ok = False
        try:
            if self._pooled and not cold and nbytes > _INLINE_MAX:
                self._backend.read_pooled(  # type: ignore[attr-defined]
                    file._handle, fd, dst, dst_offset, nbytes, file_offset, io.threads, io.task_size
                )
            elif nbytes <= SMALL_READ and self._device.is_cuda and file.io_path != "gds":
                with self._device.current():
                    self._backend.read_small(fd, dst, dst_offset, nbytes, file_offset)
            elif nbytes <= max(_INLINE_MAX, io.task_size) or io.threads == 1:
                with self._device.current():
                    self._chunks(file, fd, dst, dst_offset, file_offset, nbytes, nbytes)
            else:
                self._parallel(file, fd, dst, dst_offset, file_offset, nbytes, io)
            ok = True
        finally:
            seconds = self._stats.end(file.io_path, file.tier_key, started, nbytes, ok, source)
        return IoReport(nbytes, file.io_path, file.tier_key, seconds, cold, source=source)

    def transfer_ranges(
        self,
        file: GdsFile,
        fd: int,
        dst: Any,
        segments: Sequence[Segment],
        fence: Fence | None = None,
    ) -> IoReport:
        """Read every ``(file_offset, nbytes, dst_offset)`` of ``segments`` into ``dst``.

        A remote file hands them all to :meth:`RemoteReads.read`, which fetches them
        concurrently; several hot ranges of a local file into GPU memory go to KvikIO's pool
        at once; anything else reads them one after the other (each a transfer).
        """
        if isinstance(file, RemoteFile):
            return self.remote.read(file, dst, segments)
        if self._pooled and len(segments) > 1 and not isinstance(file, CopyFile):
            report = self._pooled_many(file, fd, dst, segments)
            if report is not None:
                return report
        parts = [self.transfer(file, fd, dst, at, off, n, fence) for off, n, at in segments]
        return merge_reports(file, parts)

    def _pooled_many(
        self, file: GdsFile, fd: int, dst: Any, segments: Sequence[Segment]
    ) -> IoReport | None:
        """Many ranges of one local file into GPU memory, all at once on KvikIO's pool (see
        :meth:`KvikioBackend.read_pooled_many`); counted as one transfer. None, reading
        nothing, where a page-cache probe of their span finds them cold: those go one by one
        by :meth:`transfer`'s cold path."""
        lo = min(off for off, _, _ in segments)
        hi = max(off + n for off, n, _ in segments)
        if hi - lo > _INLINE_MAX and (
            pagecache.residency(fd, lo, hi - lo) < self._config.cold_threshold
        ):
            return None
        total = sum(n for _, n, _ in segments)
        io = self._config.io_for(file.tier, file.rank)
        started = self._stats.begin(file.io_path, file.tier_key, "page_cache")
        ok = False
        try:
            self._backend.read_pooled_many(  # type: ignore[attr-defined]
                file._handle, fd, dst, segments, io.threads, io.task_size
            )
            ok = True
        finally:
            seconds = self._stats.end(file.io_path, file.tier_key, started, total, ok, "page_cache")
        return IoReport(total, file.io_path, file.tier_key, seconds, False, source="page_cache")

    def _chunks(
        self,
        file: GdsFile,
        fd: int,
        dst: Any,
        dst_offset: int,
        file_offset: int,
        nbytes: int,
        task: int,
    ) -> None:
        done = 0
        while done < nbytes:
            n = min(task, nbytes - done)
            self._backend.read_chunk(
                file._handle, fd, dst, dst_offset + done, n, file_offset + done
            )
            done += n

    def _parallel(
        self,
        file: GdsFile,
        fd: int,
        dst: Any,
        dst_offset: int,
        file_offset: int,
        nbytes: int,
        io: TierIo,
    ) -> None:
        pool = self._pools.for_io(io)
        read = self._backend.read_chunk
        handle = file._handle
        futures: list[Future[None]] = []
        # Align chunk boundaries in the file to the task size: direct I/O and the page cache
        # both prefer it, and only the first and last chunk can then be partial.
        pos = file_offset
        end = file_offset + nbytes
        try:
            while pos < end:
                nxt = min(end, (pos // io.task_size + 1) * io.task_size)
                futures.append(
                    pool.submit(
                        read, handle, fd, dst, dst_offset + pos - file_offset, nxt - pos, pos
                    )
                )
                pos = nxt
            for f in futures:
                f.result()
        except BaseException:
            # Every chunk must be cancelled or finished before the caller may free ``dst``.
            for f in futures:
                f.cancel()
            for f in futures:
                if not f.cancelled():
                    f.exception()
            raise


def merge_reports(file: GdsFile, parts: Sequence[IoReport]) -> IoReport:
    """One report for several reads of ``file``: its source is the slowest of theirs."""
    cold = any(r.cold for r in parts)
    source: LoadSource = "storage" if cold else parts[0].source if parts else "page_cache"
    return IoReport(
        sum(r.nbytes for r in parts),
        file.io_path,
        file.tier_key,
        sum(r.seconds for r in parts),
        cold,
        source=source,
        landed=all(r.landed for r in parts),
    )
