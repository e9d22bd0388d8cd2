"""What every kind of load shares: the engine, the lease table, the data paths and the stats.

A :class:`LoadContext` resolves a file reference to its catalog record and opens it beneath
its tier root, checks devices, keeps one :class:`~tiering.io.GpuDirectStorage` per device (all
counting into one :class:`~tiering.io.Stats`), sizes each device's lease budget, and reports
finished reads to the observer. The load modules (``loads``, ``gathers``, ``safetensors``,
``prefetch``) are free functions over it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from tiering.catalog import FileRecord, FileState
from tiering.engine import Engine
from tiering.errors import BackendUnavailable, FileNotFound, InvalidDevice, InvalidInput
from tiering.fleet.peerreader import PeerReads, PeerSource
from tiering.io import Device, GdsFile, GpuDirectStorage, IoReport, Stats, import_cupy, parse_device
from tiering.io.bufferpool import BufferPool
from tiering.serving.config import FileRef, LoaderConfig, Observer
from tiering.serving.held import Holder, still_current
from tiering.serving.leases import LeaseTable, Reservation
from tiering.serving.residency import Residency
from tiering.serving.sharedreads import SharedReads
from tiering.tiers import Stat

__all__ = ["LoadContext", "fill", "flat"]

log = logging.getLogger(__name__)


class LoadContext:
    """The state shared by every load of one :class:`~tiering.serving.Loader`.

    ``close()`` stops the lease reaper (freeing every lease) and closes the storages.
    """

    def __init__(self, engine: Engine, config: LoaderConfig, observer: Observer | None) -> None:
        self.engine = engine
        self.config = config
        self.observer = observer
        self.leases = LeaseTable(
            self.budget,
            ttl_s=config.lease_ttl_s,
            max_ttl_s=config.lease_max_ttl_s,
            reap_interval_s=config.reap_interval_s,
            pool=BufferPool(config.gpu_cache_bytes, config.gpu_cache_idle_s),
        )
        # One Stats for every device's storage, so the service reports one set of counters.
        self.stats = Stats()
        self._storages: dict[Device, GpuDirectStorage] = {}
        self._storage_lock = threading.Lock()
        #: The read-only copies of shared loads and GPU prefetches (see serving.residency).
        self.residency = Residency(
            self.leases,
            self.stats,
            self._record_access,
            keep=self.resident_budget,
            generation=self._generation,
        )
        #: Who may hold copies of files in memory, asked in order before a file is read from
        #: its tier (the GPU residency first, then the memory tier; see serving.held).
        self.holders: list[Holder] = [self.residency]
        self.reads = SharedReads()  # concurrent loads of one file's bytes read them once
        #: Reads of shared files from other hosts of the fleet (with the fleet credential).
        cfg = engine.config
        self.peers = (
            PeerReads(
                lambda: engine.catalog.db,
                host_id=cfg.host_id,
                token=cfg.fleet_token,
                host_timeout_s=cfg.host_timeout_s,
            )
            if cfg.fleet_token
            else None
        )
        if self.peers is not None and engine.memory is not None:
            engine.memory.source.peer_source = self.peer_source  # memory fills read peers too

    def _record_access(self, file_id: int) -> None:
        assert self.engine.access is not None
        self.engine.access.record(file_id)

    def _generation(self, file_id: int) -> int | None:
        try:
            return self.engine.catalog.get(file_id, cached=True).generation
        except FileNotFound:
            return None

    def close(self) -> None:
        self.residency.close()
        self.leases.stop()
        with self._storage_lock:
            storages = list(self._storages.values())
            self._storages.clear()
        for s in storages:
            s.close()
        if self.peers is not None:
            memory = self.engine.memory
            if memory is not None and memory.source.peer_source == self.peer_source:
                memory.source.peer_source = None
            self.peers.close()

    # -- devices -----------------------------------------------------------------------------
    def device(self, spec: str | Device) -> Device:
        """Parse and check a device; a CUDA device on a host without CUDA is InvalidDevice."""
        if isinstance(spec, Device):
            return spec
        try:
            return parse_device(spec)
        except BackendUnavailable as exc:
            raise InvalidDevice(
                f"{spec} does not exist: this host has no CUDA ({exc.message})", device=spec
            ) from exc

    def storage(self, device: Device) -> GpuDirectStorage:
        """The data path into ``device`` (created at first use, shared by all requests)."""
        found = self._storages.get(device)
        if found is not None:
            return found
        with self._storage_lock:
            found = self._storages.get(device)
            if found is None:
                found = GpuDirectStorage(
                    device, self.config.io, self.engine.config.tiers, stats=self.stats
                )
                self._storages[device] = found
            return found

    def budget(self, device: Device) -> int:
        """The lease budget of ``device``; the lease table asks once per device."""
        if not device.is_cuda:
            return self.config.cpu_budget_bytes
        if self.config.gpu_budget_bytes is not None:
            return self.config.gpu_budget_bytes
        cp = import_cupy()
        with cp.cuda.Device(device.index):
            free, _total = cp.cuda.runtime.memGetInfo()
        budget = int(free * self.config.gpu_budget_fraction)
        log.info(
            "lease budget of %s: %d bytes (%.0f%% of free)",
            device,
            budget,
            100 * self.config.gpu_budget_fraction,
        )
        return budget

    def resident_budget(self, device: Device) -> int:
        """Bytes of resident copies no lease holds that ``device`` keeps (see
        :mod:`tiering.serving.residency`): ``gpu_resident_bytes`` (None: the lease budget),
        ``cpu_resident_bytes`` in shared memory."""
        if not device.is_cuda:
            return self.config.cpu_resident_bytes
        n = self.config.gpu_resident_bytes
        return self.leases.budget(device) if n is None else n

    # -- files -------------------------------------------------------------------------------
    def record(self, ref: FileRef) -> FileRecord:
        """The catalog record of a file id or relpath."""
        if isinstance(ref, bool) or not isinstance(ref, (int, str)):
            raise InvalidInput(f"a file is an id or a relpath, not {ref!r}")
        return self.engine.get(ref) if isinstance(ref, int) else self.engine.lookup(ref)

    @contextlib.contextmanager
    def open(
        self, ref: FileRef, storage: GpuDirectStorage, *, copies: str = "any"
    ) -> Iterator[tuple[GdsFile, int]]:
        """Open a catalog file for ``storage``; counts one access.

        A copy held in memory (see :mod:`tiering.serving.held`) is read instead when one is
        current, else this host's current copy of a fleet's origin file on its own directory
        tier, else another host's verified copy of it (:mod:`tiering.fleet.peerreader`: the
        bucket only for what no peer gives): ``copies`` is ``"any"``, ``"host"`` (gathers,
        which need host rows) or ``"none"``.

        A source that is a local file is opened through the descriptor its tier opened beneath
        the root (its reads get the tier's I/O path: GDS, KvikIO, host). Any other source
        (an object-store tier's object, pinned to the ETag the catalog recorded) becomes a
        remote file, read by ranged reads without a local copy; a changed object raises
        :class:`~tiering.errors.FileChanged` here or at its first read, never stale bytes.
        """
        # A load being served: moves yield to it, whichever copy serves it (see ServingGate).
        self.engine.mover.gate.touch()
        if isinstance(ref, int) and not isinstance(ref, bool):
            file_id = ref
        elif isinstance(ref, str):
            file_id = self.engine.lookup(ref, cached=True).id
        else:
            file_id = self.record(ref).id  # raises the clear error for a bad reference
        if copies != "none" and self.holders:
            opened = self._open_copy(file_id, storage, host_only=copies == "host")
            if opened is not None:
                with opened:
                    yield opened, file_id
                return
        if copies != "none" and self.engine.host_copies is not None:
            opened = self._open_disk_copy(file_id, storage)
            if opened is not None:
                with opened:
                    yield opened, file_id
                return
        if copies != "none" and self.peers is not None:
            opened = self._open_peer(file_id, storage)
            if opened is not None:
                with opened:
                    yield opened, file_id
                return
        content = self.engine.open_content(file_id, trust_catalog=True)
        rec = content.record
        try:
            tier = self.engine.tiers.get(rec.tier)
            local = content.source.local_file()
            if local is not None:
                f = storage.open_file(local.path, fd=local.fd)
                content.close()  # the file keeps a duplicate of the descriptor
            else:
                f = storage.open_source(content.source, tier=tier.name, rank=tier.rank)
        except BaseException:
            content.close()
            raise
        with f:
            yield f, rec.id

    def _open_copy(
        self, file_id: int, storage: GpuDirectStorage, *, host_only: bool
    ) -> GdsFile | None:
        """A current copy of the file held in memory, opened for ``storage``; counts one
        access. None when no holder has one (nothing counted)."""
        rec = self.engine.catalog.get(file_id, cached=True)
        if rec.state != FileState.STABLE and rec.state != FileState.MIGRATING:
            return None
        tier = self.engine.tiers.get(rec.tier)
        for holder in self.holders:
            held = holder.acquire(rec, storage.device)
            if held is None:
                continue
            # Host rows are one array of the whole file: not a GPU copy, nor one whose head
            # (a shard's header) is kept apart.
            apart = held.held_on.is_cuda or bool(held.head)
            if (host_only and apart) or not still_current(held, rec, tier):
                held.release()
                continue
            try:
                f = storage.open_copy(
                    held.array,
                    held.held_on,
                    name=rec.relpath,
                    tier=tier.name,
                    rank=tier.rank,
                    on_close=held.release,
                    head=held.head,
                )
            except BaseException:
                held.release()
                raise
            assert self.engine.access is not None
            self.engine.access.record(rec.id)
            return f
        return None

    def _open_disk_copy(self, file_id: int, storage: GpuDirectStorage) -> GdsFile | None:
        """This host's current copy of a fleet's origin file on one of its directory tiers
        (see :mod:`tiering.copies.hostcopies`), opened for ``storage`` as a file of that
        tier (its I/O path, its source rules); counts one access. None: no current copy."""
        hc = self.engine.host_copies
        assert hc is not None
        entry = hc.get(file_id)
        if entry is None:
            return None  # the common case costs no catalog read
        src = hc.open(self.engine.catalog.get(file_id, cached=True))
        if src is None:
            return None
        local = src.local_file()
        if local is None:
            tier = self.engine.tiers.get(entry.tier)
            try:
                f = storage.open_source(src, tier=tier.name, rank=tier.rank)  # it owns src now
            except BaseException:
                src.close()
                raise
        else:
            with src:  # the file keeps a duplicate of the descriptor
                f = storage.open_file(local.path, fd=local.fd)
        assert self.engine.access is not None
        self.engine.access.record(file_id)
        return f

    def peer_source(self, rec: FileRecord) -> PeerSource | None:
        """A fleet's shared file read from the peers that hold its current generation whole
        (see :mod:`tiering.fleet.peerreader`; the bucket for what no peer gives). None: not a
        shared file, no peer holds it, or no peer reads on this host."""
        peers = self.peers
        if peers is None or rec.host is not None:
            return None
        if rec.state not in (FileState.STABLE, FileState.MIGRATING):
            return None
        tier = self.engine.tiers.get(rec.tier)
        if not tier.capabilities.shared:
            return None
        known = Stat(rec.size, rec.mtime_ns, rec.etag or "", checksum=rec.checksum)
        try:
            ranges = peers.open(
                rec, fallback=lambda: tier.open(rec.relpath, etag=rec.etag, known=known)
            )
        except Exception as exc:  # peers are a faster way, never the only one: the bucket
            log.warning("no peer read of %s: %s", rec.relpath, exc)
            return None
        return None if ranges is None else PeerSource(rec, ranges)

    def _open_peer(self, file_id: int, storage: GpuDirectStorage) -> GdsFile | None:
        """:meth:`peer_source` of the file, opened for ``storage`` as a remote file of its
        tier; counts one access."""
        rec = self.engine.catalog.get(file_id)  # not cached: a peer serves only the current
        source = self.peer_source(rec)
        if source is None:
            return None
        tier = self.engine.tiers.get(rec.tier)
        try:
            f = storage.open_source(source, tier=tier.name, rank=tier.rank)  # it owns source
        except BaseException:
            source.close()
            raise
        assert self.engine.access is not None
        self.engine.access.record(file_id)
        return f

    def observe(self, op: str, device: Device, report: IoReport) -> None:
        """Tell the observer about a finished read; its failure never fails the load."""
        if self.observer is not None:
            try:
                self.observer(op, device, report)
            except Exception:
                log.exception("load observer failed")


def fill(
    storage: GpuDirectStorage, f: GdsFile, offset: int, res: Reservation, n: int, at: int = 0
) -> IoReport:
    """Read ``n`` bytes of ``f`` from ``offset`` into the buffer attached to ``res``, from
    its byte ``at``."""
    if n == 0:
        return IoReport(0, f.io_path, f.tier_key, 0.0, source=getattr(f, "source", "page_cache"))
    with storage.device.current():
        report = storage.load_to_gpu(f, offset, flat(res, at + n)[at:])
        assert res.buffer is not None
        res.buffer.synchronize()  # the client may read as soon as it has the reply
    return report


def flat(res: Reservation, n: int) -> Any:
    """The first ``n`` bytes of the buffer attached to ``res``, as a flat uint8 array."""
    assert res.buffer is not None
    return res.buffer.array()[:n]
