"""Loads for other processes: catalog files into leased buffers on ``cuda:N`` or ``cpu``.

The service's side of DESIGN.md's "Buffers" section. A :class:`Loader` resolves files through
the engine's catalog (by id or relpath; never a filesystem path from a client), opens them
beneath their tier root (which counts one access each), reserves the device's lease budget,
allocates a dedicated buffer (:mod:`tiering.io.buffers`), fills it with :mod:`tiering.io`, and
hands it out as a :class:`~tiering.serving.leases.Lease`. On any error everything reserved or
allocated for the request is given back before the error propagates.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiering.catalog import FileRecord
from tiering.engine import Engine
from tiering.errors import (
    BackendUnavailable,
    IndexOutOfRange,
    InvalidDevice,
    InvalidDtype,
    InvalidInput,
    InvalidRange,
    TierdError,
    TooLarge,
)
from tiering.io import Device, GdsConfig, GdsFile, GpuDirectStorage, IoReport, Stats, parse_device
from tiering.io._device import import_cupy
from tiering.io.buffers import BufferPool, alloc_size
from tiering.moves import Cancelled
from tiering.serving.jobs import Job, JobCancelled, JobTable
from tiering.serving.leases import Lease, LeaseTable, Reservation

__all__ = [
    "FileRef",
    "LoadItem",
    "Loader",
    "LoaderConfig",
    "PREFETCH_TARGETS",
    "TensorLoc",
    "TensorsLoaded",
]

log = logging.getLogger(__name__)

MiB = 1 << 20

FileRef = int | str
"""A catalog file id, or a relpath."""

PREFETCH_TARGETS = ("gpu", "nvme", "page_cache")

Observer = Callable[[str, Device, IoReport], None]
"""``observer(op, device, report)``: called after every successful read (for metrics)."""


@dataclass(frozen=True)
class LoaderConfig:
    """Settings of the :class:`Loader`; ``app.settings`` builds it from ``TIERD_BUFFERS__*``.

    Parameters
    ----------
    lease_ttl_s, lease_max_ttl_s:
        Default and longest lifetime of a lease.
    reap_interval_s:
        How often expired leases are freed.
    cpu_budget_bytes:
        Bytes that may be leased in shared memory.
    gpu_budget_fraction:
        Share of a GPU's free memory (when it is first used) that may be leased.
    gpu_budget_bytes:
        A fixed budget per GPU instead of the fraction.
    max_gather_indices:
        Longest index list of a gather (more: TooLarge).
    max_batch_items:
        Most items in one batch load, and most files in one safetensors load or prefetch.
    load_concurrency:
        Items of a batch loaded at once.
    prefetch_concurrency:
        Prefetch jobs running at once; more wait in a queue.
    prefetch_chunk_bytes:
        Granularity of prefetch progress and cancellation.
    job_retention_s:
        How long finished jobs stay visible.
    gpu_cache_bytes, gpu_cache_idle_s:
        Released GPU buffers kept for reuse, per device, and for how long (see
        :class:`~tiering.io.buffers.BufferPool`); always within the budget.
    io:
        Data-path settings for every device's :class:`~tiering.io.GpuDirectStorage`.
    """

    lease_ttl_s: float = 300.0
    lease_max_ttl_s: float = 3600.0
    reap_interval_s: float = 1.0
    cpu_budget_bytes: int = 4 << 30
    gpu_budget_fraction: float = 0.5
    gpu_budget_bytes: int | None = None
    max_gather_indices: int = 1 << 22
    max_batch_items: int = 1024
    load_concurrency: int = 8
    prefetch_concurrency: int = 2
    prefetch_chunk_bytes: int = 64 * MiB
    job_retention_s: float = 3600.0
    gpu_cache_bytes: int = 2 << 30
    gpu_cache_idle_s: float = 30.0
    io: GdsConfig = field(default_factory=GdsConfig)


@dataclass(frozen=True)
class LoadItem:
    """One range of a batch load; ``device`` ``None`` takes the batch's."""

    file: FileRef
    offset: int = 0
    length: int | None = None
    dtype: str = "uint8"
    shape: Sequence[int] | None = None
    device: str | None = None


@dataclass(frozen=True)
class TensorLoc:
    """Where one safetensors tensor lies: a lease and a byte offset inside it."""

    buffer_id: str
    offset: int
    dtype: str  # the safetensors name: F32, BF16, ...
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class TensorsLoaded:
    leases: list[Lease]
    tensors: dict[str, TensorLoc]


def parse_dtype(spec: str) -> np.dtype[Any]:
    """A plain numeric NumPy dtype in native byte order.

    Raises
    ------
    InvalidDtype
    """
    try:
        dt: np.dtype[Any] = np.dtype(spec)
    except (TypeError, ValueError) as exc:
        raise InvalidDtype(f"not a dtype: {spec!r}", dtype=str(spec)) from exc
    if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        raise InvalidDtype(f"dtype {spec!r} is not a plain numeric dtype", dtype=str(spec))
    if dt.byteorder not in ("=", "|") and dt.byteorder != np.dtype(dt.name).byteorder:
        raise InvalidDtype(f"dtype {spec!r} is not in this host's byte order", dtype=str(spec))
    return dt


def _shape(nbytes: int, dt: np.dtype[Any], shape: Sequence[int] | None) -> tuple[int, ...]:
    if nbytes % dt.itemsize:
        raise InvalidDtype(
            f"{nbytes} bytes is not a whole number of {dt.name} items ({dt.itemsize} bytes each)",
            dtype=dt.name,
            length=nbytes,
        )
    items = nbytes // dt.itemsize
    if shape is None:
        return (items,)
    dims = [int(d) for d in shape]
    if dims.count(-1) > 1 or any(d < -1 for d in dims):
        raise InvalidInput(f"bad shape {list(shape)}: sizes >= 0, at most one -1")
    if -1 in dims:
        rest = math.prod(d for d in dims if d != -1)
        if rest == 0 or items % rest:
            raise InvalidInput(f"shape {dims} does not fit {items} items of {dt.name}")
        dims[dims.index(-1)] = items // rest
    if math.prod(dims) != items:
        raise InvalidInput(
            f"shape {dims} holds {math.prod(dims)} items but the range has {items} "
            f"items of {dt.name}",
            items=items,
        )
    return tuple(dims)


def _range(offset: int, length: int | None, size: int) -> int:
    if offset < 0 or offset > size:
        raise InvalidRange(f"offset {offset} is outside the {size} byte file", size=size)
    n = size - offset if length is None else length
    if n < 0 or offset + n > size:
        raise InvalidRange(
            f"range [{offset}, {offset + n}) is outside the {size} byte file", size=size
        )
    return n


class Loader:
    """Fills leased buffers from catalog files; see the module docstring.

    ``start()`` starts the lease reaper; ``stop()`` cancels the jobs, frees every lease and
    closes the storages. The engine must be started first and stopped after.
    """

    def __init__(
        self, engine: Engine, config: LoaderConfig | None = None, observer: Observer | None = None
    ) -> None:
        self.engine = engine
        self.config = config = config or LoaderConfig()
        self.observer = observer
        self.leases = LeaseTable(
            self._budget,
            ttl_s=config.lease_ttl_s,
            max_ttl_s=config.lease_max_ttl_s,
            reap_interval_s=config.reap_interval_s,
            pool=BufferPool(config.gpu_cache_bytes, config.gpu_cache_idle_s),
        )
        self.jobs = JobTable(
            concurrency=config.prefetch_concurrency, retention_s=config.job_retention_s
        )
        self._stats = Stats()
        self._storages: dict[Device, GpuDirectStorage] = {}
        self._storage_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Loader:
        self.leases.start()
        return self

    def stop(self) -> None:
        self.jobs.stop()
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self.leases.stop()
        with self._storage_lock:
            storages = list(self._storages.values())
            self._storages.clear()
        for s in storages:
            s.close()

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
                    device, self.config.io, self.engine.config.tiers, stats=self._stats
                )
                self._storages[device] = found
            return found

    def _budget(self, device: Device) -> int:
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

    # -- files -------------------------------------------------------------------------------
    def record(self, ref: FileRef) -> FileRecord:
        """The catalog record of a file id or relpath."""
        if isinstance(ref, bool) or not isinstance(ref, (int, str)):
            raise InvalidInput(f"a file is an id or a relpath, not {ref!r}")
        return self.engine.get(ref) if isinstance(ref, int) else self.engine.lookup(ref)

    @contextlib.contextmanager
    def _open(self, ref: FileRef, storage: GpuDirectStorage) -> Iterator[tuple[GdsFile, int]]:
        """Open a catalog file beneath its tier root for ``storage``; counts one access."""
        if isinstance(ref, int) and not isinstance(ref, bool):
            file_id = ref
        elif isinstance(ref, str):
            file_id = self.engine.lookup(ref, cached=True).id
        else:
            file_id = self.record(ref).id  # raises the clear error for a bad reference
        content = self.engine.open_content(file_id)
        try:
            rec = content.record
            path = self.engine.tiers.get(rec.tier).root / rec.relpath
            f = storage.open_file(path, fd=content.fd)
        finally:
            content.close()
        with f:
            yield f, rec.id

    def _observe(self, op: str, device: Device, report: IoReport) -> None:
        if self.observer is not None:
            try:
                self.observer(op, device, report)
            except Exception:
                log.exception("load observer failed")

    @staticmethod
    def _fill(
        storage: GpuDirectStorage, f: GdsFile, offset: int, res: Reservation, n: int
    ) -> IoReport:
        assert res.buffer is not None
        if n == 0:
            return IoReport(0, f.io_path, f.tier_key, 0.0)
        storage.device.make_current()
        report = storage.load_to_gpu(f, offset, res.buffer.array()[:n])
        res.buffer.synchronize()  # the client may read as soon as it has the reply
        return report

    # -- loads -------------------------------------------------------------------------------
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
    ) -> Lease:
        """Load ``length`` bytes (default: to the end) from ``offset`` into a new lease.

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
        dev = self.device(device)
        dt = parse_dtype(dtype)
        self.leases.ttl(ttl_s)
        storage = self.storage(dev)
        with self._open(file, storage) as (f, file_id):
            n = _range(offset, length, f.size())
            shp = _shape(n, dt, shape)
            with self.leases.reserve(dev, alloc_size(dev, n)) as res:
                res.attach(self.leases.pool.get(dev, n))
                report = self._fill(storage, f, offset, res, n)
                lease = self.leases.grant(
                    res,
                    nbytes=n,
                    dtype=dt.name,
                    shape=shp,
                    kind="load",
                    file_ids=(file_id,),
                    report=report,
                    ttl_s=ttl_s,
                )
        self._observe("load", dev, report)
        return lease

    def load_batch(
        self,
        items: Sequence[LoadItem],
        *,
        device: str | Device = "cpu",
        ttl_s: float | None = None,
    ) -> list[Lease]:
        """Load many ranges at once, all or nothing.

        Every file is opened, every range checked and the budget of all of them reserved
        before the first byte is read; the reads then run ``load_concurrency`` at a time.

        Raises
        ------
        TooLarge
            More than ``max_batch_items`` items.
        """
        if len(items) > self.config.max_batch_items:
            raise TooLarge(
                f"{len(items)} items is over the limit of {self.config.max_batch_items}",
                limit=self.config.max_batch_items,
            )
        self.leases.ttl(ttl_s)
        prepared: list[
            tuple[
                Device,
                GpuDirectStorage,
                GdsFile,
                int,
                int,
                int,
                np.dtype[Any],
                tuple[int, ...],
                Reservation,
            ]
        ] = []
        leases: list[Lease] = []
        with contextlib.ExitStack() as stack:
            for it in items:
                dev = self.device(it.device or device)
                dt = parse_dtype(it.dtype)
                storage = self.storage(dev)
                f, file_id = stack.enter_context(self._open(it.file, storage))
                n = _range(it.offset, it.length, f.size())
                shp = _shape(n, dt, it.shape)
                res = stack.enter_context(self.leases.reserve(dev, alloc_size(dev, n)))
                prepared.append((dev, storage, f, file_id, it.offset, n, dt, shp, res))
            for dev, _s, _f, _id, _o, n, *_rest, res in prepared:
                res.attach(self.leases.pool.get(dev, n))
            reports = self._fan_out(
                [
                    functools.partial(self._fill, s, f, o, r, n)
                    for _d, s, f, _id, o, n, _dt, _shp, r in prepared
                ]
            )
            try:
                for (_dev, _s, _f, file_id, _o, n, dt, shp, res), report in zip(
                    prepared, reports, strict=True
                ):
                    leases.append(
                        self.leases.grant(
                            res,
                            nbytes=n,
                            dtype=dt.name,
                            shape=shp,
                            kind="load",
                            file_ids=(file_id,),
                            report=report,
                            ttl_s=ttl_s,
                        )
                    )
            except BaseException:
                self.leases.release_many([lease.id for lease in leases])
                raise
        for lease in leases:
            assert lease.report is not None
            self._observe("batch", lease.device, lease.report)
        return leases

    def _fan_out(self, calls: list[Callable[[], IoReport]]) -> list[IoReport]:
        if len(calls) <= 1:
            return [c() for c in calls]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.config.load_concurrency, thread_name_prefix="tierd-load"
                )
            pool = self._pool
        futures = [pool.submit(c) for c in calls]
        errors = [fut.exception() for fut in futures]  # every read ends before buffers go
        for err in errors:
            if err is not None:
                raise err
        return [fut.result() for fut in futures]

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
    ) -> Lease:
        """Rows of a row-major ``(rows, dim)`` matrix file into a ``(n, dim)`` lease.

        Either ``indices`` (any order, duplicates allowed) or ``start`` and ``count``.

        Raises
        ------
        TooLarge
            More than ``max_gather_indices`` indices.
        IndexOutOfRange, InvalidDtype, InvalidInput
        """
        by_index = indices is not None
        if by_index == (start is not None or count is not None) or (
            not by_index and (start is None or count is None)
        ):
            raise InvalidInput("give either indices, or start and count")
        if indices is not None and len(indices) > self.config.max_gather_indices:
            raise TooLarge(
                f"{len(indices)} indices is over the limit of {self.config.max_gather_indices}",
                limit=self.config.max_gather_indices,
            )
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise InvalidInput(f"dim must be a positive integer, got {dim!r}")
        dev = self.device(device)
        dt = parse_dtype(dtype)
        self.leases.ttl(ttl_s)
        storage = self.storage(dev)
        with self._open(file, storage) as (f, file_id):
            row = dim * dt.itemsize
            if f.size() % row:
                raise InvalidDtype(
                    f"{f.size()} bytes is not a whole number of rows of {dim} x {dt.name} "
                    f"({row} bytes each)",
                    dtype=dt.name,
                    dim=dim,
                )
            nrows = f.size() // row
            idx: np.ndarray | None = None
            if indices is not None:
                try:
                    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
                except (TypeError, ValueError, OverflowError) as exc:
                    raise InvalidInput(f"indices must be integers: {exc}") from exc
                if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= nrows):
                    bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
                    raise IndexOutOfRange(
                        f"row index {bad} is outside the {nrows} row matrix", index=bad, rows=nrows
                    )
                rows = int(idx.size)
            else:
                assert start is not None and count is not None
                if start < 0 or count < 0 or start + count > nrows:
                    raise IndexOutOfRange(
                        f"rows [{start}, {start + count}) are outside the {nrows} row matrix",
                        rows=nrows,
                    )
                rows = count
            n = rows * row
            with self.leases.reserve(dev, alloc_size(dev, n)) as res:
                buf = res.attach(self.leases.pool.get(dev, n))
                if n == 0:
                    report = IoReport(0, "host", f.tier_key, 0.0)
                elif idx is not None:
                    storage.device.make_current()
                    report = storage.prefetch_vectors(f, idx, dim, dt, buf.array()[:n])
                    buf.synchronize()
                else:
                    assert start is not None
                    report = self._fill(storage, f, start * row, res, n)
                lease = self.leases.grant(
                    res,
                    nbytes=n,
                    dtype=dt.name,
                    shape=(rows, dim),
                    kind="gather",
                    file_ids=(file_id,),
                    report=report,
                    ttl_s=ttl_s,
                )
        self._observe("gather", dev, report)
        return lease

    def load_safetensors(
        self,
        files: Sequence[FileRef],
        *,
        names: Sequence[str] | None = None,
        device: str | Device = "cpu",
        ttl_s: float | None = None,
    ) -> TensorsLoaded:
        """Load the tensors (all, or ``names``) of safetensors shards: one lease per shard.

        Raises
        ------
        MalformedFile, InvalidDtype, InvalidInput
            A bad header, a tensor in two shards, or a name in none.
        TooLarge
            More than ``max_batch_items`` files.
        """
        if not files:
            raise InvalidInput("name at least one file")
        if len(files) > self.config.max_batch_items:
            raise TooLarge(
                f"{len(files)} files is over the limit of {self.config.max_batch_items}",
                limit=self.config.max_batch_items,
            )
        dev = self.device(device)
        self.leases.ttl(ttl_s)
        storage = self.storage(dev)
        lock = threading.Lock()
        reserved: list[Reservation] = []
        by_array: dict[int, Reservation] = {}

        def alloc(nbytes: int) -> Any:
            res = self.leases.reserve(dev, alloc_size(dev, nbytes))
            with lock:
                reserved.append(res)
            buf = res.attach(self.leases.pool.get(dev, nbytes))
            arr = buf.array()[:nbytes]
            with lock:
                by_array[id(arr)] = res
            return arr

        leases: list[Lease] = []
        tensors: dict[str, TensorLoc] = {}
        with contextlib.ExitStack() as stack:
            opened = [stack.enter_context(self._open(ref, storage)) for ref in files]
            try:
                storage.device.make_current()
                shards = storage.load_safetensors_raw([f for f, _ in opened], names, alloc)
                for shard, (_f, file_id) in zip(shards, opened, strict=True):
                    res = by_array[id(shard.buffer)]
                    if not shard.tensors:
                        res.cancel()  # nothing selected from this shard
                        continue
                    assert res.buffer is not None
                    res.buffer.synchronize()
                    layout = {
                        name: {
                            "offset": at,
                            "dtype": t.dtype,
                            "shape": list(t.shape),
                            "nbytes": t.nbytes,
                        }
                        for name, (at, t) in shard.tensors.items()
                    }
                    n = int(shard.buffer.nbytes)
                    lease = self.leases.grant(
                        res,
                        nbytes=n,
                        dtype="uint8",
                        shape=(n,),
                        kind="safetensors",
                        file_ids=(file_id,),
                        report=shard.report,
                        ttl_s=ttl_s,
                        tensors=layout,
                    )
                    leases.append(lease)
                    for name, (at, t) in shard.tensors.items():
                        tensors[name] = TensorLoc(lease.id, at, t.dtype, t.shape, t.nbytes)
            except BaseException:
                self.leases.release_many([lease.id for lease in leases])
                for res in reserved:
                    res.cancel()
                raise
        for lease in leases:
            assert lease.report is not None
            self._observe("safetensors", dev, lease.report)
        return TensorsLoaded(leases, tensors)

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
        keeps it for ``ttl_s``; ``nvme`` promotes each file to the fastest tier through the
        mover; ``page_cache`` reads each file through, so the next load is hot.

        Raises
        ------
        FileNotFound
            A file is not in the catalog (checked before the job starts).
        """
        if target not in PREFETCH_TARGETS:
            raise InvalidInput(
                f"target must be one of {', '.join(PREFETCH_TARGETS)}, got {target!r}"
            )
        if not files:
            raise InvalidInput("name at least one file")
        if len(files) > self.config.max_batch_items:
            raise TooLarge(
                f"{len(files)} files is over the limit of {self.config.max_batch_items}",
                limit=self.config.max_batch_items,
            )
        recs: dict[int, FileRecord] = {}
        for ref in files:
            rec = self.record(ref)
            recs.setdefault(rec.id, rec)
        todo = list(recs.values())
        dev: Device | None = None
        if target == "gpu":
            dev = self.device(device or "cuda:0")
            self.leases.ttl(ttl_s)
        elif device is not None:
            raise InvalidInput(f"device applies to target gpu only, not {target}")
        job = Job(
            id="",
            kind="prefetch",
            target=target,
            files_total=len(todo),
            bytes_total=sum(r.size for r in todo),
            device=str(dev) if dev else None,
        )
        if target == "gpu":
            assert dev is not None
            gpu_dev = dev
            return self.jobs.submit(
                job,
                lambda j: self._prefetch_gpu(j, todo, gpu_dev, ttl_s),
                self._prefetch_cleanup,
            )
        if target == "nvme":
            return self.jobs.submit(job, lambda j: self._prefetch_nvme(j, todo))
        return self.jobs.submit(job, lambda j: self._prefetch_page_cache(j, todo))

    def _prefetch_cleanup(self, job: Job) -> None:
        # Cancelled: the warm leases are not wanted. Failed: keep the ones that loaded.
        if job.cancel.is_set():
            with job.lock:
                ids, job.lease_ids = job.lease_ids, []
            self.leases.release_many(ids)

    @staticmethod
    def _file_error(job: Job, rec: FileRecord, exc: TierdError) -> None:
        with job.lock:
            job.errors.append(
                {"file_id": rec.id, "path": rec.relpath, "code": exc.code, "message": exc.message}
            )

    def _prefetch_gpu(
        self, job: Job, recs: list[FileRecord], dev: Device, ttl_s: float | None
    ) -> None:
        storage = self.storage(dev)
        chunk = self.config.prefetch_chunk_bytes
        for rec in recs:
            job.check()
            try:
                with self._open(rec.id, storage) as (f, file_id):
                    n = f.size()
                    with self.leases.reserve(dev, alloc_size(dev, n)) as res:
                        buf = res.attach(self.leases.pool.get(dev, n))
                        arr = buf.array()
                        storage.device.make_current()
                        started = time.perf_counter()
                        pos = 0
                        while pos < n:
                            job.check()
                            k = min(chunk, n - pos)
                            storage.load_to_gpu(f, pos, arr[pos : pos + k])
                            pos += k
                            job.add(nbytes=k)
                        del arr
                        buf.synchronize()
                        report = IoReport(n, f.io_path, f.tier_key, time.perf_counter() - started)
                        lease = self.leases.grant(
                            res,
                            nbytes=n,
                            dtype="uint8",
                            shape=(n,),
                            kind="prefetch",
                            file_ids=(file_id,),
                            report=report,
                            ttl_s=ttl_s,
                        )
            except TierdError as exc:
                self._file_error(job, rec, exc)
                continue
            with job.lock:
                job.lease_ids.append(lease.id)
                job.files_done += 1
            self._observe("prefetch", dev, report)

    def _prefetch_nvme(self, job: Job, recs: list[FileRecord]) -> None:
        fastest = self.engine.tiers.fastest.name
        for rec in recs:
            job.check()
            base = job.bytes_done
            try:
                if self.engine.access is not None:
                    self.engine.access.record(rec.id)
                current = self.engine.get(rec.id)
                if current.tier != fastest:

                    def progress(done: int, _total: int, base: int = base) -> None:
                        with job.lock:
                            job.bytes_done = base + done

                    self.engine.mover.migrate(
                        rec.id, fastest, reason="prefetch", progress=progress, cancel=job.cancel
                    )
            except Cancelled as exc:
                if job.cancel.is_set():
                    raise JobCancelled from exc
                self._file_error(job, rec, exc)
            except TierdError as exc:
                self._file_error(job, rec, exc)
            with job.lock:
                job.bytes_done = base + rec.size
                job.files_done += 1

    def _prefetch_page_cache(self, job: Job, recs: list[FileRecord]) -> None:
        chunk = min(self.config.prefetch_chunk_bytes, 8 * MiB)
        buf = bytearray(chunk)
        view = memoryview(buf)
        for rec in recs:
            job.check()
            try:
                content = self.engine.open_content(rec.id)
            except TierdError as exc:
                self._file_error(job, rec, exc)
                continue
            try:
                with contextlib.suppress(OSError, AttributeError):
                    os.posix_fadvise(content.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                pos = 0
                while pos < content.size:
                    job.check()
                    got = os.preadv(content.fd, [view[: min(chunk, content.size - pos)]], pos)
                    if got <= 0:
                        break
                    pos += got
                    job.add(nbytes=got)
            finally:
                content.close()
            job.add(files=1)

    # -- stats -------------------------------------------------------------------------------
    def stats(self) -> Any:
        """tiering.io's counters over every device: a :class:`~tiering.io.GdsStatsSnapshot`."""
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        self._stats.reset()
