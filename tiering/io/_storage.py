""":class:`GpuDirectStorage`: the tier-aware data path into GPU (or host) memory."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import numpy as np

from tiering.config import TierConfig
from tiering.errors import (
    FileNotFound,
    IndexOutOfRange,
    InvalidDevice,
    InvalidDtype,
    InvalidInput,
    InvalidRange,
    MisalignedBuffer,
    TierdError,
)

from . import _pagecache, _write
from ._backends import SMALL_READ, Backend, Chosen, choose_backend
from ._config import GdsConfig, TierIo
from ._device import Device, import_cupy, parse_device
from ._file import GdsFile
from ._gather import PinnedPool, gather_rows
from ._stats import UNTIERED, GdsStatsSnapshot, IoPath, IoReport, Stats
from .safetensors import Framework, LoadedTensors

if TYPE_CHECKING:
    from ._shards import ShardLayout

__all__ = ["BatchResult", "GpuDirectStorage", "ReadResult"]

log = logging.getLogger("tiering.io")

P = ParamSpec("P")
R = TypeVar("R")

# Below this size a read skips the page-cache probe and the thread pool: 4 KiB reads are
# latency-bound and a mincore() or a thread hop costs more than the read itself.
_INLINE_MAX = 1 << 20
_PROBE_MIN = 64 << 20


@dataclass(frozen=True)
class ReadResult:
    """An array that a call filled, and the :class:`IoReport` of how."""

    array: Any
    report: IoReport


class BatchResult(Mapping[Any, Any]):
    """``{path: array}`` for :meth:`GpuDirectStorage.load_models_batch`, with ``reports``."""

    def __init__(self, arrays: dict[Any, Any], reports: dict[Any, IoReport]) -> None:
        self._arrays = arrays
        self.reports = reports

    def __getitem__(self, key: Any) -> Any:
        return self._arrays[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


def _no_readahead(fd: int, handle: Any) -> None:
    """Turn off read-ahead on the file's descriptors.

    A cold 4 KiB read would otherwise pull in 128 KiB around it (p99 latency), while large
    reads lose nothing: with FADV_RANDOM the kernel still reads each request whole.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    fds = [fd]
    if handle is not None and hasattr(handle, "fileno"):
        fds.append(int(handle.fileno()))
    for d in fds:
        with contextlib.suppress(OSError):
            os.posix_fadvise(d, 0, 0, os.POSIX_FADV_RANDOM)


def _parse_dtype(dtype: Any) -> np.dtype[Any]:
    try:
        dt: np.dtype[Any] = np.dtype(dtype)
    except TypeError as exc:
        raise InvalidDtype(f"not a dtype: {dtype!r}", dtype=str(dtype)) from exc
    if dt.hasobject or dt.itemsize == 0 or dt.kind in "OSUMm":
        raise InvalidDtype(f"dtype {dt} cannot be read from raw bytes", dtype=str(dt))
    return dt


class GpuDirectStorage:
    """Reads files into GPU (``cuda:N``, CuPy arrays) or host (``cpu``, NumPy) memory.

    Parameters
    ----------
    device:
        ``"cuda:N"`` or ``"cpu"``.
    config:
        I/O settings; see :class:`GdsConfig`.
    tiers:
        Tier roots, fastest first. A file under the first one reads on the fast path (GDS
        where the host has it) with ``config.fast_tier_io``; files under slower tiers take the
        bounce-buffer path with ``config.slow_tier_io``.
    stats:
        Counters to add to (default: the storage's own); see :meth:`stats`.

    Every blocking method has an ``a``-prefixed ``async`` twin that runs it on the storage's
    thread pool. All methods are thread-safe. Close the storage (or use it as a context
    manager) to stop its threads.

    Raises
    ------
    InvalidDevice
        No such device.
    BackendUnavailable
        ``config.backend`` names a backend (or the device needs CuPy) that is not installed.
    """

    def __init__(
        self,
        device: str | int | Device,
        config: GdsConfig | None = None,
        tiers: Sequence[TierConfig] | None = None,
        *,
        stats: Stats | None = None,
    ) -> None:
        self.device = parse_device(device)
        self.config = config or GdsConfig()
        self._chosen: Chosen = choose_backend(self.config.backend, self.device, self.config.enabled)
        self._backend: Backend = self._chosen.backend
        # Hot GPU loads go through KvikIO's C++ thread pool (see KvikioBackend.read_pooled);
        # cold ones through tierd's threads with cold_io's few large requests.
        self._pooled = self.device.is_cuda and hasattr(self._backend, "read_pooled")
        if self._pooled:
            hot = [
                self.config.fast_tier_io,
                self.config.slow_tier_io,
                *self.config.tier_io.values(),
            ]
            self._backend.ensure_pool(max(io.threads for io in hot))  # type: ignore[attr-defined]
        self._tiers = [
            (t.name, rank, Path(os.path.realpath(t.path))) for rank, t in enumerate(tiers or ())
        ]
        # Storages of several devices may share one Stats, for one snapshot of them all.
        self._stats = stats if stats is not None else Stats()
        self._lock = threading.Lock()
        self._pools: dict[TierIo, ThreadPoolExecutor] = {}
        self._aux: dict[str, ThreadPoolExecutor] = {}
        self._pinned = PinnedPool() if self.device.is_cuda else None
        self._closed = False
        log.info(
            "tiering.io: device=%s backend=%s gds=%s (%s)",
            self.device,
            self._backend.name,
            self._chosen.gds_available,
            self._chosen.reason,
        )

    # -- facts -------------------------------------------------------------------------

    @staticmethod
    def is_available() -> bool:
        """Whether GDS proper (KvikIO + cuFile + nvidia-fs) is usable on this host."""
        from ._backends import _gds_available, _import_kvikio

        try:
            return _gds_available(_import_kvikio())[0]
        except TierdError:
            return False

    @property
    def backend(self) -> str:
        """The backend in use: ``"kvikio"`` or ``"host"``."""
        return self._backend.name

    @property
    def backend_reason(self) -> str:
        """Why this backend (and GDS or not) was chosen."""
        return self._chosen.reason

    @property
    def gds_available(self) -> bool:
        return self._chosen.gds_available

    def tier_of(self, path: str | os.PathLike[str]) -> tuple[str, int] | None:
        """The ``(name, rank)`` of the tier whose root contains ``path``, if any."""
        real = Path(os.path.realpath(path))
        for name, rank, root in self._tiers:
            if real == root or root in real.parents:
                return name, rank
        return None

    # -- pools -----------------------------------------------------------------------------

    def _pool_for(self, io: TierIo) -> ThreadPoolExecutor:
        with self._lock:
            self._check_open()
            pool = self._pools.get(io)
            if pool is None:
                pool = ThreadPoolExecutor(
                    max_workers=io.threads,
                    thread_name_prefix=f"tierd-io-{io.threads}x{io.task_size >> 10}k",
                    initializer=self.device.make_current,
                )
                self._pools[io] = pool
            return pool

    def _aux_pool(self, kind: str) -> ThreadPoolExecutor:
        size = {
            "batch": self.config.max_concurrent_ops,
            "async": self.config.thread_pool_size,
            "gather": self.config.gather_threads,
        }[kind]
        with self._lock:
            self._check_open()
            pool = self._aux.get(kind)
            if pool is None:
                pool = ThreadPoolExecutor(
                    max_workers=size,
                    thread_name_prefix=f"tierd-{kind}",
                    initializer=self.device.make_current,
                )
                self._aux[kind] = pool
            return pool

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInput("this GpuDirectStorage is closed")

    def close(self) -> None:
        """Stop the storage's threads and free its staging memory. Idempotent."""
        with self._lock:
            self._closed = True
            pools = [*self._pools.values(), *self._aux.values()]
            self._pools.clear()
            self._aux.clear()
        for pool in pools:
            pool.shutdown(wait=True)
        if self._pinned is not None:
            self._pinned.clear()

    def __enter__(self) -> GpuDirectStorage:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- files ---------------------------------------------------------------------------

    def open_file(self, path: str | os.PathLike[str], *, fd: int | None = None) -> GdsFile:
        """Open a regular file for reading, on the I/O path its tier gets.

        Parameters
        ----------
        path:
            The file. With ``fd`` it only names the file: its tier, and messages.
        fd:
            A descriptor the caller already opened read-only (tierd's service opens files
            beneath their tier root, never by a path a client sent). The file keeps a
            duplicate of it; the caller still closes its own. The backend's handle opens the
            same inode through ``/proc/self/fd``, not through ``path``.

        Raises
        ------
        FileNotFound
            No such file, or not a regular file.
        """
        self._check_open()
        p = Path(path)
        by_fd = fd is not None
        try:
            fd = os.dup(fd) if fd is not None else os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise FileNotFound(f"no such file: {p}", path=str(p)) from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FileNotFound(f"not a regular file: {p}", path=str(p))
            found = self.tier_of(p)
            tier, rank = found if found else (None, None)
            io = self.config.io_for(tier, rank)
            direct = bool(
                self.device.is_cuda
                and self._chosen.gds_available
                and (io.direct if io.direct is not None else rank in (None, 0))
            )
            name = f"/proc/self/fd/{fd}" if by_fd else str(p)
            handle = self._backend.open(name, direct) if self.device.is_cuda else None
            _no_readahead(fd, handle)
            io_path = self._backend.io_path(handle, self.device)
        except BaseException:
            os.close(fd)
            raise
        return GdsFile(
            p,
            fd,
            st.st_size,
            tier=tier,
            rank=rank,
            alignment=self.config.alignment,
            handle=handle,
            io_path=io_path,
            owner=self,
        )

    def _own(self, file: GdsFile) -> None:
        if not isinstance(file, GdsFile):
            raise InvalidInput(f"expected a GdsFile from open_file(), got {type(file).__name__}")
        if file._owner is not self:
            raise InvalidInput("this GdsFile was opened by another GpuDirectStorage")

    # -- the one transfer primitive --------------------------------------------------------

    def _transfer(
        self, file: GdsFile, fd: int, dst: Any, dst_offset: int, file_offset: int, nbytes: int
    ) -> IoReport:
        """Read ``nbytes`` at ``file_offset`` into flat uint8 ``dst[dst_offset:]``."""
        io = self.config.io_for(file.tier, file.rank)
        cold = False
        if nbytes >= _PROBE_MIN:
            cold = _pagecache.residency(fd, file_offset, nbytes) < self.config.cold_threshold
            if cold:
                io = self.config.cold_io
        started = self._stats.begin(file.io_path, file.tier_key)
        ok = False
        try:
            if self._pooled and not cold and nbytes > _INLINE_MAX:
                self._backend.read_pooled(  # type: ignore[attr-defined]
                    file._handle, fd, dst, dst_offset, nbytes, file_offset, io.threads, io.task_size
                )
            elif nbytes <= SMALL_READ and self.device.is_cuda and file.io_path != "gds":
                self.device.make_current()
                self._backend.read_small(fd, dst, dst_offset, nbytes, file_offset)
            elif nbytes <= max(_INLINE_MAX, io.task_size) or io.threads == 1:
                self.device.make_current()
                self._chunks(file, fd, dst, dst_offset, file_offset, nbytes, nbytes)
            else:
                self._parallel(file, fd, dst, dst_offset, file_offset, nbytes, io)
            ok = True
        finally:
            seconds = self._stats.end(file.io_path, file.tier_key, started, nbytes, ok)
        return IoReport(nbytes, file.io_path, file.tier_key, seconds, cold)

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
        pool = self._pool_for(io)
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

    # -- validation ------------------------------------------------------------------------

    def _range(self, file: GdsFile, offset: int, length: int | None) -> int:
        size = file.size()
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
            raise InvalidRange(f"offset must be an integer, got {offset!r}")
        if length is not None and (
            isinstance(length, bool) or not isinstance(length, (int, np.integer))
        ):
            raise InvalidRange(f"length must be an integer, got {length!r}")
        offset = int(offset)
        if offset < 0 or offset > size:
            raise InvalidRange(
                f"offset {offset} is outside the {size} byte file", offset=offset, size=size
            )
        n = size - offset if length is None else int(length)
        if n < 0 or offset + n > size:
            raise InvalidRange(
                f"range [{offset}, {offset + n}) is outside the {size} byte file",
                offset=offset,
                length=n,
                size=size,
            )
        return n

    def _target(self, buffer: Any) -> Any:
        """A flat uint8 view of a caller's buffer on this storage's device."""
        on_gpu = hasattr(buffer, "__cuda_array_interface__")
        flat = self._flat_fast(buffer, on_gpu)
        if flat is not None:
            return flat
        if self.device.is_cuda:
            if not on_gpu:
                raise InvalidDevice(
                    f"buffer is in host memory but this storage loads into {self.device}"
                )
            cp = import_cupy()
            arr = cp.asarray(buffer)  # no copy: wraps __cuda_array_interface__
            if arr.device.id != self.device.index:
                raise InvalidDevice(
                    f"buffer is on cuda:{arr.device.id} but this storage loads into {self.device}"
                )
        else:
            if on_gpu:
                raise InvalidDevice("buffer is in GPU memory but this storage loads into cpu")
            try:
                arr = (
                    np.asarray(memoryview(buffer)) if not isinstance(buffer, np.ndarray) else buffer
                )
            except TypeError as exc:
                raise InvalidInput(f"not a buffer: {type(buffer).__name__}") from exc
            if not arr.flags.writeable:
                raise InvalidInput("buffer is read-only")
        if not arr.flags.c_contiguous:
            raise MisalignedBuffer("buffer must be C-contiguous")
        return arr.reshape(-1).view(np.uint8) if arr.ndim else arr.reshape(1).view(np.uint8)

    def _flat_fast(self, buffer: Any, on_gpu: bool) -> Any:
        """The common case, a flat uint8 array on the right device, without new views."""
        if getattr(buffer, "ndim", 0) != 1 or getattr(buffer, "dtype", None) != np.uint8:
            return None
        if self.device.is_cuda:
            if on_gpu and type(buffer).__module__.startswith("cupy"):
                data = buffer.data
                if data.device_id == self.device.index and buffer.flags.c_contiguous:
                    return buffer
            return None
        if isinstance(buffer, np.ndarray) and buffer.flags.c_contiguous and buffer.flags.writeable:
            return buffer
        return None

    def _check_alignment(self, offset: int, nbytes: int, flat: Any) -> None:
        if not self.config.require_alignment:
            return
        a = self.config.alignment
        ptr = int(flat.data.ptr) if self.device.is_cuda else int(flat.ctypes.data)
        for what, value in (("offset", offset), ("length", nbytes), ("buffer address", ptr)):
            if value % a:
                raise MisalignedBuffer(
                    f"{what} {value:#x} is not a multiple of the {a} byte alignment",
                    alignment=a,
                )

    # -- public API: loads -----------------------------------------------------------------

    def load_to_gpu(self, file: GdsFile, offset: int, buffer: Any) -> IoReport:
        """Fill ``buffer`` with ``buffer.nbytes`` bytes of ``file`` from ``offset``.

        Parameters
        ----------
        file:
            From :meth:`open_file`.
        offset:
            Byte offset in the file.
        buffer:
            A C-contiguous array on this storage's device (CuPy or anything with
            ``__cuda_array_interface__`` for ``cuda:N``; NumPy or a writable buffer for
            ``cpu``). Its dtype does not matter; its bytes are overwritten.

        Returns
        -------
        IoReport
            Bytes moved (``int(report)``), the I/O path, the tier and GB/s.

        Raises
        ------
        InvalidRange, MisalignedBuffer, InvalidDevice, ClosedFile
        """
        self._own(file)
        flat = self._target(buffer)
        self._range(file, offset, flat.nbytes)
        self._check_alignment(int(offset), flat.nbytes, flat)
        with file._use() as fd:
            return self._transfer(file, fd, flat, 0, int(offset), flat.nbytes)

    def read(
        self, file: GdsFile, offset: int = 0, length: int | None = None, dtype: Any = np.uint8
    ) -> ReadResult:
        """Read ``length`` bytes (default: to the end) from ``offset`` into a new array.

        The array is on the storage's device, flat, of ``dtype``.

        Raises
        ------
        InvalidRange
            The range is outside the file.
        InvalidDtype
            Unknown dtype, or its item size does not divide ``length``.
        ClosedFile
        """
        self._own(file)
        dt = _parse_dtype(dtype)
        n = self._range(file, offset, length)
        if n % dt.itemsize:
            raise InvalidDtype(
                f"{n} bytes is not a whole number of {dt} items ({dt.itemsize} bytes each)",
                dtype=str(dt),
                length=n,
            )
        with file._use() as fd:
            out = self.device.empty(n)
            report = self._transfer(file, fd, out, 0, int(offset), n)
        return ReadResult(out.view(dt), report)

    def load_file(self, path: str | os.PathLike[str] | GdsFile) -> ReadResult:
        """Read a whole file (a path or an open :class:`GdsFile`) into a new uint8 array."""
        if isinstance(path, GdsFile):
            return self.read(path)
        with self.open_file(path) as f:
            return self.read(f)

    def load_models_batch(self, paths: Iterable[str | os.PathLike[str]]) -> BatchResult:
        """Load whole files concurrently (up to ``max_concurrent_ops`` at once).

        All files are opened before any is read, so a missing one fails the call with
        nothing allocated. Returns ``{path: array}`` keyed by the paths as given.
        """
        keys = list(paths)
        files: list[GdsFile] = []
        try:
            for k in keys:
                files.append(self.open_file(k))
            results = self._fan_out(self.read, [(f,) for f in files])
        finally:
            for f in files:
                f.close()
        return BatchResult(
            {k: r.array for k, r in zip(keys, results, strict=True)},
            {k: r.report for k, r in zip(keys, results, strict=True)},
        )

    def _fan_out(self, fn: Callable[..., R], calls: Sequence[tuple[Any, ...]]) -> list[R]:
        if len(calls) <= 1:
            return [fn(*args) for args in calls]
        pool = self._aux_pool("batch")
        futures = [pool.submit(fn, *args) for args in calls]
        errors = [f.exception() for f in futures]
        for err in errors:
            if err is not None:
                raise err
        return [f.result() for f in futures]

    # -- public API: vectors ---------------------------------------------------------------

    def _matrix(self, file: GdsFile, dim: int, dtype: Any) -> tuple[np.dtype[Any], int, int]:
        dt = _parse_dtype(dtype)
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
            raise InvalidInput(f"dim must be a positive integer, got {dim!r}")
        row = int(dim) * dt.itemsize
        if file.size() % row:
            raise InvalidDtype(
                f"{file.size()} bytes is not a whole number of rows of {dim} x {dt} "
                f"({row} bytes each)",
                dtype=str(dt),
                dim=int(dim),
            )
        return dt, row, file.size() // row

    def read_vectors(
        self, file: GdsFile, start: int, count: int, dim: int, dtype: Any = np.float32
    ) -> ReadResult:
        """Rows ``start .. start+count`` of a row-major ``(rows, dim)`` matrix file.

        One contiguous read. Returns a ``(count, dim)`` array of ``dtype``.

        Raises
        ------
        IndexOutOfRange, InvalidDtype, InvalidInput, ClosedFile
        """
        self._own(file)
        dt, row, nrows = self._matrix(file, dim, dtype)
        for name, v in (("start", start), ("count", count)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise InvalidInput(f"{name} must be an integer, got {v!r}")
        if start < 0 or count < 0 or start + count > nrows:
            raise IndexOutOfRange(
                f"rows [{start}, {start + count}) are outside the {nrows} row matrix",
                rows=nrows,
            )
        n = int(count) * row
        with file._use() as fd:
            out = self.device.empty(n)
            report = self._transfer(file, fd, out, 0, int(start) * row, n)
        return ReadResult(out.view(dt).reshape(int(count), int(dim)), report)

    def _indices(self, indices: Any, nrows: int) -> np.ndarray:
        if hasattr(indices, "__cuda_array_interface__"):
            indices = import_cupy().asnumpy(indices)
        idx = np.asarray(indices)
        if idx.size == 0:
            return np.empty(0, dtype=np.intp)
        if idx.dtype.kind not in "iu":
            raise InvalidInput(f"indices must be integers, got dtype {idx.dtype}")
        idx = idx.reshape(-1)
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= nrows:
            bad = lo if lo < 0 else hi
            raise IndexOutOfRange(
                f"row index {bad} is outside the {nrows} row matrix", index=bad, rows=nrows
            )
        return idx.astype(np.intp, copy=False)

    def prefetch_vectors(
        self, file: GdsFile, indices: Any, dim: int, dtype: Any, buffer: Any
    ) -> IoReport:
        """Gather rows ``indices`` (any order, duplicates allowed) into ``buffer``.

        Rows land in request order. ``buffer`` must hold exactly ``len(indices)`` rows.

        Raises
        ------
        IndexOutOfRange, InvalidDtype, InvalidRange, InvalidDevice, ClosedFile
        """
        self._own(file)
        dt, row, nrows = self._matrix(file, dim, dtype)
        idx = self._indices(indices, nrows)
        flat = self._target(buffer)
        if flat.nbytes != idx.size * row:
            raise InvalidRange(
                f"buffer holds {flat.nbytes} bytes but {idx.size} rows need {idx.size * row}"
            )
        with file._use() as fd:
            return self._gather(file, fd, idx, row, flat)

    def gather(self, file: GdsFile, indices: Any, dim: int, dtype: Any = np.float32) -> ReadResult:
        """Like :meth:`prefetch_vectors`, into a new ``(len(indices), dim)`` array."""
        self._own(file)
        dt, row, nrows = self._matrix(file, dim, dtype)
        idx = self._indices(indices, nrows)
        with file._use() as fd:
            out = self.device.empty(idx.size * row)
            report = self._gather(file, fd, idx, row, out)
        return ReadResult(out.view(dt).reshape(idx.size, int(dim)), report)

    def _gather(self, file: GdsFile, fd: int, idx: np.ndarray, row: int, flat: Any) -> IoReport:
        # The gather's I/O is tierd's own (memory map or preadv), whatever the backend.
        started = self._stats.begin("host", file.tier_key)
        ok = False
        try:
            if idx.size:
                hot = None

                def rows() -> np.ndarray:
                    nonlocal hot
                    if hot is None and file._map is None:
                        hot = _pagecache.residency(fd, 0, file.size()) >= self.config.cold_threshold
                    return file._rows(populate=bool(hot))

                gather_rows(
                    fd=fd,
                    rows=rows,
                    idx=idx,
                    row_bytes=row,
                    out=flat,
                    device=self.device,
                    pool=self._aux_pool("gather"),
                    threads=self.config.gather_threads,
                    batch_bytes=self.config.prefetch_batch_size,
                    pinned=self._pinned,
                )
            ok = True
        finally:
            nbytes = idx.size * row
            seconds = self._stats.end("host", file.tier_key, started, nbytes, ok)
        return IoReport(nbytes, "host", file.tier_key, seconds)

    # -- public API: safetensors and writes ------------------------------------------------

    def load_safetensors(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        names: Iterable[str] | None = None,
        framework: Framework = "auto",
    ) -> LoadedTensors:
        """Load all tensors, or ``names``, of one or more safetensors shards.

        Every header is parsed and checked before any memory is allocated. Each shard is read
        into one allocation; shards load concurrently. See :mod:`tiering.io.safetensors` for
        how BF16 and F8 tensors are returned.

        Raises
        ------
        MalformedFile, InvalidDtype, InvalidInput, FileNotFound
        """
        from ._shards import load_shards

        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        return load_shards(self, list(paths), names, framework)

    def load_safetensors_raw(
        self,
        files: Sequence[str | os.PathLike[str] | GdsFile],
        names: Iterable[str] | None = None,
        allocate: Callable[[int], Any] | None = None,
    ) -> list[ShardLayout]:
        """Like :meth:`load_safetensors`, but return each shard's allocation and layout.

        For callers that own the memory (tierd's service hands it to another process):
        ``allocate(nbytes)`` must return a flat ``uint8`` array on this storage's device, and
        is called once per shard, only after every header has been read and checked. Open
        :class:`GdsFile` items are read as they are and left open.

        Raises
        ------
        MalformedFile, InvalidDtype, InvalidInput, FileNotFound
        """
        from ._shards import load_shards_raw

        return load_shards_raw(self, list(files), names, allocate)

    def write_from_gpu(
        self, buffer: Any, path: str | os.PathLike[str], *, overwrite: bool = False
    ) -> IoReport:
        """Write a buffer's bytes to a new file, crash-safely.

        The bytes go to a temporary file in the destination directory, are fsynced, and the
        file is published under ``path`` only when complete (``overwrite=False``: by a hard
        link, which fails if ``path`` exists). A crash leaves either no file or the whole
        file, plus at worst a ``*.tierd-tmp`` file that tierd's recovery removes.

        Raises
        ------
        AlreadyExists
            ``path`` exists and ``overwrite`` is false.
        FileNotFound
            The destination directory does not exist.
        """
        self._check_open()
        if hasattr(buffer, "__cuda_array_interface__"):
            cp = import_cupy()
            arr = cp.asarray(buffer)
            if not arr.flags.c_contiguous:
                raise MisalignedBuffer("buffer must be C-contiguous")
            flat = arr.reshape(-1).view(cp.uint8)
        else:
            arr = np.asarray(buffer)
            if not arr.flags.c_contiguous:
                raise MisalignedBuffer("buffer must be C-contiguous")
            flat = arr.reshape(-1).view(np.uint8)
        found = self.tier_of(Path(path).parent)
        tier_key = found[0] if found else UNTIERED
        on_gpu = hasattr(buffer, "__cuda_array_interface__")
        # Writes never take the direct path: they are rare, and the compat path's O_DIRECT
        # writes through a bounce buffer are what KvikIO does without nvidia-fs anyway.
        io_path: IoPath = "compat" if on_gpu and self.backend == "kvikio" else "host"
        started = self._stats.begin(io_path, tier_key)
        ok = False
        try:
            _write.write_atomic(self._backend, flat, Path(path), overwrite=overwrite)
            ok = True
        finally:
            seconds = self._stats.end(io_path, tier_key, started, flat.nbytes, ok)
        return IoReport(int(flat.nbytes), io_path, tier_key, seconds)

    # -- stats -----------------------------------------------------------------------------

    def stats(self) -> GdsStatsSnapshot:
        """A snapshot of the counters, in total, per I/O path and per tier."""
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        """Zero the counters."""
        self._stats.reset()

    # -- async twins -------------------------------------------------------------------------

    async def _run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._aux_pool("async"), functools.partial(fn, *args, **kwargs)
        )

    async def aopen_file(self, path: str | os.PathLike[str]) -> GdsFile:
        """``async`` twin of :meth:`open_file`."""
        return await self._run(self.open_file, path)

    async def aload_to_gpu(self, file: GdsFile, offset: int, buffer: Any) -> IoReport:
        """``async`` twin of :meth:`load_to_gpu`."""
        return await self._run(self.load_to_gpu, file, offset, buffer)

    async def aread(
        self, file: GdsFile, offset: int = 0, length: int | None = None, dtype: Any = np.uint8
    ) -> ReadResult:
        """``async`` twin of :meth:`read`."""
        return await self._run(self.read, file, offset, length, dtype)

    async def aload_file(self, path: str | os.PathLike[str] | GdsFile) -> ReadResult:
        """``async`` twin of :meth:`load_file`."""
        return await self._run(self.load_file, path)

    async def aload_models_batch(self, paths: Iterable[str | os.PathLike[str]]) -> BatchResult:
        """``async`` twin of :meth:`load_models_batch`."""
        return await self._run(self.load_models_batch, list(paths))

    async def aread_vectors(
        self, file: GdsFile, start: int, count: int, dim: int, dtype: Any = np.float32
    ) -> ReadResult:
        """``async`` twin of :meth:`read_vectors`."""
        return await self._run(self.read_vectors, file, start, count, dim, dtype)

    async def aprefetch_vectors(
        self, file: GdsFile, indices: Any, dim: int, dtype: Any, buffer: Any
    ) -> IoReport:
        """``async`` twin of :meth:`prefetch_vectors`."""
        return await self._run(self.prefetch_vectors, file, indices, dim, dtype, buffer)

    async def agather(
        self, file: GdsFile, indices: Any, dim: int, dtype: Any = np.float32
    ) -> ReadResult:
        """``async`` twin of :meth:`gather`."""
        return await self._run(self.gather, file, indices, dim, dtype)

    async def aload_safetensors(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        names: Iterable[str] | None = None,
        framework: Framework = "auto",
    ) -> LoadedTensors:
        """``async`` twin of :meth:`load_safetensors`."""
        return await self._run(self.load_safetensors, paths, names, framework)

    async def awrite_from_gpu(
        self, buffer: Any, path: str | os.PathLike[str], *, overwrite: bool = False
    ) -> IoReport:
        """``async`` twin of :meth:`write_from_gpu`."""
        return await self._run(self.write_from_gpu, buffer, path, overwrite=overwrite)

    def __repr__(self) -> str:
        return (
            f"<GpuDirectStorage device={self.device} backend={self.backend} "
            f"gds={self.gds_available}>"
        )
