"""Loads for other processes: catalog files into leased buffers on ``cuda:N`` or ``cpu``.

The service's side of DESIGN.md's "Buffers" section. A :class:`Loader` resolves files through
the engine's catalog (by id or relpath; never a filesystem path from a client), opens them
beneath their tier root, or as objects of an object-store tier at the ETag the catalog
recorded (either counts one access), reserves the device's lease budget,
allocates a dedicated buffer (:mod:`tiering.io.buffers`), fills it with :mod:`tiering.io`, and
hands it out as a :class:`~tiering.serving.leases.Lease`. On any error everything reserved or
allocated for the request is given back before the error propagates.

Every load takes its destination as ``device``: one device (``"cuda:0"``, a
:class:`~tiering.io.Device`), or a :class:`~tiering.io.target.LoadTarget` parsed once where the
request came in (several devices, ``cuda:*``, a sharding with a rank), which then returns one
entry per device. The target travels down as it is; see :mod:`tiering.io.target`.

The loader is a façade: the shared state lives in a
:class:`~tiering.serving.context.LoadContext`, and each kind of load is a free function over
it (:mod:`~tiering.serving.loads`, :mod:`~tiering.serving.gathers`,
:mod:`~tiering.serving.safetensors`, :mod:`~tiering.serving.prefetch`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, overload

import numpy as np

from tiering.catalog import FileRecord
from tiering.engine import Engine
from tiering.fleet.peerreader import PeerReads
from tiering.io import Device, GpuDirectStorage, IoReport
from tiering.io.shm import sweep_segments
from tiering.io.target import LoadTarget
from tiering.serving.config import FileRef, LoaderConfig, Observer
from tiering.serving.context import LoadContext
from tiering.serving.devices import place
from tiering.serving.devstats import DeviceStats
from tiering.serving.jobs import Job, JobTable
from tiering.serving.leases import Lease, LeaseTable
from tiering.serving.loads import FanOut, LoadItem, load_many
from tiering.serving.memory import MemoryHolder
from tiering.serving.models import Models
from tiering.serving.prefetch import start_prefetch
from tiering.serving.replicas import Replica, gather_to, replicate_range
from tiering.serving.residency import Residency
from tiering.serving.safetensors import TensorsLoaded
from tiering.serving.sharded import DeviceLoaded, load_devices
from tiering.serving.warmup import warm_devices
from tiering.tiers import Source

__all__ = ["Loader"]


log = logging.getLogger(__name__)


class Loader:
    """Fills leased buffers from catalog files; see the module docstring.

    ``start()`` starts the lease reaper; ``stop()`` cancels the jobs, frees every lease and
    closes the storages. The engine must be started first and stopped after.
    """

    def __init__(
        self, engine: Engine, config: LoaderConfig | None = None, observer: Observer | None = None
    ) -> None:
        self._ctx = ctx = LoadContext(engine, config or LoaderConfig(), None)
        #: Loads per device (bytes, operations, GB/s): counted before the observer is told.
        self.device_stats = DeviceStats()
        self._observer = observer
        ctx.observer = self._observe
        if engine.memory is not None:  # asked after the GPU residency: see LoadContext.holders
            ctx.holders.append(MemoryHolder(engine, engine.memory))
        self.leases: LeaseTable = ctx.leases
        self.jobs = JobTable(
            concurrency=ctx.config.prefetch_concurrency, retention_s=ctx.config.job_retention_s
        )
        self._fan_out = FanOut(ctx.config.load_concurrency)
        #: Hugging Face model directories as units: list, show, load, prefetch, pin.
        self.models = Models(ctx, self.jobs)

    @property
    def engine(self) -> Engine:
        return self._ctx.engine

    @property
    def config(self) -> LoaderConfig:
        return self._ctx.config

    @property
    def residency(self) -> Residency:
        """The read-only copies of shared loads and GPU prefetches, by content."""
        return self._ctx.residency

    @property
    def peers(self) -> PeerReads | None:
        """Loads' reads from other hosts of the fleet (None without a fleet credential)."""
        return self._ctx.peers

    @property
    def observer(self) -> Observer | None:
        """Called after every successful read; may be replaced at any time."""
        return self._observer

    @observer.setter
    def observer(self, observer: Observer | None) -> None:
        self._observer = observer

    def _observe(self, op: str, device: Device, report: IoReport) -> None:
        self.device_stats.record(device, report)
        if self._observer is not None:
            self._observer(op, device, report)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Loader:
        swept = sweep_segments()  # a killed run's cpu leases: host memory until unlinked
        if swept:
            log.warning("removed %d shared-memory segments of tierd runs that are gone", len(swept))
        self.leases.start()
        return self

    def warm(self) -> dict[str, float]:
        """Pay each GPU's one-time costs now rather than in the first load (see
        :mod:`tiering.serving.warmup`); seconds per device warmed."""
        return warm_devices(self._ctx)

    def stop(self) -> None:
        # Jobs first (they read and lease), then the batch pool, then leases and storages.
        self.jobs.stop()
        self._fan_out.close()
        self._ctx.close()

    # -- devices and files -------------------------------------------------------------------
    def device(self, spec: str | Device) -> Device:
        """Parse and check a device; a CUDA device on a host without CUDA is InvalidDevice."""
        return self._ctx.device(spec)

    def storage(self, device: Device) -> GpuDirectStorage:
        """The data path into ``device`` (created at first use, shared by all requests)."""
        return self._ctx.storage(device)

    def peer_source(self, rec: FileRecord) -> Source | None:
        """A fleet's shared file read from the peers holding its current generation (each
        piece checked; the bucket for what no peer gives), or None (see
        :meth:`LoadContext.peer_source <tiering.serving.context.LoadContext.peer_source>`)."""
        return self._ctx.peer_source(rec)

    def record(self, ref: FileRef) -> FileRecord:
        """The catalog record of a file id or relpath."""
        return self._ctx.record(ref)

    # -- loads -------------------------------------------------------------------------------
    @overload
    def load(
        self,
        file: FileRef,
        *,
        offset: int = 0,
        length: int | None = None,
        device: str | Device = "cpu",
        dtype: str = "uint8",
        shape: Sequence[int] | None = None,
        ttl_s: float | None = None,
        shared: bool = False,
    ) -> Lease: ...

    @overload
    def load(
        self,
        file: FileRef,
        *,
        offset: int = 0,
        length: int | None = None,
        device: LoadTarget,
        dtype: str = "uint8",
        shape: Sequence[int] | None = None,
        ttl_s: float | None = None,
        shared: bool = False,
    ) -> list[Replica]: ...

    def load(
        self,
        file: FileRef,
        *,
        offset: int = 0,
        length: int | None = None,
        device: str | Device | LoadTarget = "cpu",
        dtype: str = "uint8",
        shape: Sequence[int] | None = None,
        ttl_s: float | None = None,
        shared: bool = False,
    ) -> Lease | list[Replica]:
        """Load ``length`` bytes (default: to the end) from ``offset`` into a new lease.

        ``device`` a :class:`~tiering.io.target.LoadTarget` of several devices (or
        ``cuda:*``): the same bytes on each, storage read once, one
        :class:`~tiering.serving.replicas.Replica` per device. Where every pair of GPUs has
        peer access (and peer copies measured faster than staging through the host; setting
        ``gpu_delivery``), each device reads 1/N of the range at once over its own host link
        and the devices exchange their parts GPU to GPU (delivery ``split``). Elsewhere the
        first device reads it all and the others get its bytes through pinned host staging
        (``host``). A budget overrun on any device leaves nothing leased anywhere.

        ``shared=True`` (one device only) is a read-only contract: the caller promises never
        to write the buffer. In return, a range already resident on ``device`` (from an
        earlier shared load or a GPU prefetch of the same file at the same generation) is
        handed out again: the same allocation (CUDA IPC handle or shared-memory segment), no
        read, no new bytes against the budget. Otherwise it is read into a new read-only
        buffer that stays resident while any lease holds it, and after (see
        :mod:`tiering.serving.residency`). The lease and its handle say ``read_only``.

        Raises
        ------
        FileNotFound, InvalidPath
            No such file in the catalog (or on disk).
        InvalidRange
            The range is outside the file.
        InvalidDevice, InvalidDtype, InvalidInput
            No such device; a dtype that does not divide the length; a shape that does not
            match.
        InsufficientSpace
            Over the device's lease budget (or no shared memory left).
        """
        out = replicate_range(
            self._ctx,
            file,
            place(self._ctx, LoadTarget.of(device)),
            offset=offset,
            length=length,
            dtype=dtype,
            shape=shape,
            ttl_s=ttl_s,
            shared=shared,
        )
        return out if isinstance(device, LoadTarget) else out[0].lease

    def load_batch(
        self,
        items: Sequence[LoadItem],
        *,
        device: str | Device = "cpu",
        ttl_s: float | None = None,
        shared: bool = False,
    ) -> list[Lease]:
        """Load many ranges at once, all or nothing.

        Every file is opened, every range checked and the budget of all of them reserved
        before the first byte is read; the reads then run ``load_concurrency`` at a time.
        ``shared`` applies to every item (see :meth:`load`).

        Raises
        ------
        TooLarge
            More than ``max_batch_items`` items.
        """
        return load_many(self._ctx, self._fan_out, items, device=device, ttl_s=ttl_s, shared=shared)

    @overload
    def gather(
        self,
        file: FileRef,
        *,
        dim: int,
        dtype: str = "float32",
        indices: Sequence[int] | np.ndarray | None = None,
        start: int | None = None,
        count: int | None = None,
        device: str | Device = "cpu",
        ttl_s: float | None = None,
    ) -> Lease: ...

    @overload
    def gather(
        self,
        file: FileRef,
        *,
        dim: int,
        dtype: str = "float32",
        indices: Sequence[int] | np.ndarray | None = None,
        start: int | None = None,
        count: int | None = None,
        device: LoadTarget,
        ttl_s: float | None = None,
    ) -> list[Replica]: ...

    def gather(
        self,
        file: FileRef,
        *,
        dim: int,
        dtype: str = "float32",
        indices: Sequence[int] | np.ndarray | None = None,
        start: int | None = None,
        count: int | None = None,
        device: str | Device | LoadTarget = "cpu",
        ttl_s: float | None = None,
    ) -> Lease | list[Replica]:
        """Rows of a row-major ``(rows, dim)`` matrix file into a ``(n, dim)`` lease.

        Either ``indices`` (any order, duplicates allowed) or ``start`` and ``count``.
        ``device`` a :class:`~tiering.io.target.LoadTarget` of several devices: the first
        gathers the rows (they are scattered, so there is no one range to split), the others
        get them by peer copy or through pinned host staging; one Replica per device.

        Raises
        ------
        TooLarge
            More than ``max_gather_indices`` indices.
        IndexOutOfRange, InvalidDtype, InvalidInput
        """
        out = gather_to(
            self._ctx,
            file,
            place(self._ctx, LoadTarget.of(device)),
            dim=dim,
            dtype=dtype,
            indices=indices,
            start=start,
            count=count,
            ttl_s=ttl_s,
        )
        return out if isinstance(device, LoadTarget) else out[0].lease

    @overload
    def load_safetensors(
        self,
        files: Sequence[FileRef],
        *,
        names: Sequence[str] | None = None,
        device: str | Device = "cpu",
        ttl_s: float | None = None,
        shared: bool = False,
        wait: bool = True,
    ) -> TensorsLoaded: ...

    @overload
    def load_safetensors(
        self,
        files: Sequence[FileRef],
        *,
        names: Sequence[str] | None = None,
        device: LoadTarget,
        ttl_s: float | None = None,
        shared: bool = False,
        wait: bool = True,
    ) -> list[DeviceLoaded]: ...

    def load_safetensors(
        self,
        files: Sequence[FileRef],
        *,
        names: Sequence[str] | None = None,
        device: str | Device | LoadTarget = "cpu",
        ttl_s: float | None = None,
        shared: bool = False,
        wait: bool = True,
    ) -> TensorsLoaded | list[DeviceLoaded]:
        """Load the tensors (all, or ``names``) of safetensors shards: one lease per shard.

        ``shared`` (one device only; see :meth:`load`): a shard whose selected tensors are
        resident on ``device`` is handed out again, allocation and layout as they are.

        ``wait`` false (for a caller in another process that waits itself): return once the
        copies of bytes held in memory into one GPU are queued, before they land; each
        buffer's handle then carries the ``ready_event`` to wait on (see
        :mod:`tiering.io.fences`). Other reads, loads into several devices and ``shared``
        loads have landed on return either way.

        ``device`` a :class:`~tiering.io.target.LoadTarget`: returns one
        :class:`~tiering.serving.sharded.DeviceLoaded` per device. Without a sharding each
        device gets every tensor, storage read once; with a tensor-parallel spec (see
        :mod:`tiering.io.sharding`) each rank's slices go to its device: every rank (one
        device per rank, in rank order), or the target's ``rank`` into its one device. Each
        tensor says its slice's shape, the whole tensor's shape and the slice's offset in it.

        Raises
        ------
        MalformedFile, InvalidDtype, InvalidInput
            A bad header, a tensor in two shards, or a name in none.
        InvalidSharding, InvalidDevice
            A spec that does not fit the tensors, a device count that does not fit the
            ranks; an unknown device.
        InsufficientSpace
            Over the budget of any device (nothing is left leased on the others).
        TooLarge
            More than ``max_batch_items`` files.
        """
        out = load_devices(
            self._ctx,
            files,
            place(self._ctx, LoadTarget.of(device)),
            names=names,
            ttl_s=ttl_s,
            shared=shared,
            wait=wait,
        )
        return out if isinstance(device, LoadTarget) else out[0].loaded

    # -- prefetch ----------------------------------------------------------------------------
    def prefetch(
        self,
        files: Sequence[FileRef],
        *,
        target: str,
        device: str | Device | None = None,
        ttl_s: float | None = None,
    ) -> Job:
        """Start a background job that warms ``files`` up; returns it at once.

        Targets: ``gpu`` loads each file into a lease on ``device`` (default ``cuda:0``) and
        keeps it for ``ttl_s``, as a read-only resident copy (a ``shared`` load of the file is
        handed the same allocation, and other loads copy from it); ``memory`` copies each
        file into the engine's memory tier (InvalidInput without one); ``nvme`` promotes each
        file to the fastest tier through the mover; ``page_cache`` reads each file through,
        so the next load is hot. A file on an object-store tier has no page cache:
        ``page_cache`` promotes it to the nearest faster local tier instead (a file with none
        is reported as the job's error for that file).

        Raises
        ------
        FileNotFound
            A file is not in the catalog (checked before the job starts).
        """
        return start_prefetch(
            self._ctx, self.jobs, files, target=target, device=device, ttl_s=ttl_s
        )

    # -- stats -------------------------------------------------------------------------------
    def stats(self) -> Any:
        """tiering.io's counters over every device: a :class:`~tiering.io.GdsStatsSnapshot`."""
        return self._ctx.stats.snapshot()

    def reset_stats(self) -> None:
        self._ctx.stats.reset()
        self.device_stats.reset()
