""":class:`GpuDirectStorage`: the tier-aware data path into GPU (or host) memory.

The class is a façade: it owns the storage's parts and their lifecycle, checks that each file
is its own, and hands the work to the modules beside it: :mod:`._open` (opening files),
:mod:`._checks` (callers' arguments), :mod:`._transfer` (every read of a byte range; those of
remote files go on to :mod:`._remote`), :mod:`._vectors` (rows and gathers), :mod:`._shards`
(safetensors), :mod:`._write` (writes) and :mod:`._pools` (its threads).

Kept whole past 450 lines: the façade's public methods, one per kind of read, each a few lines
over its parts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import numpy as np

from tiering.closing import Closing
from tiering.config import TierConfig
from tiering.errors import InvalidDtype, InvalidInput, TierdError
from tiering.tiers import Source

from . import _write
from ._aio import AsyncTwins
from ._backends import Backend, Chosen, choose_backend
from ._checks import check_alignment, check_range, flat_target, parse_dtype
from ._config import GdsConfig
from ._copies import CopyFile
from ._device import Device, parse_device
from ._file import GdsFile
from ._gather import PinnedPool
from ._open import open_gds_file
from ._pools import Pools
from ._remote import RemoteFile
from ._results import BatchResult, ReadResult
from ._shards import ShardLayout, TransferRanges, load_shards, load_shards_raw
from ._stats import GdsStatsSnapshot, IoReport, Stats
from ._transfer import Transfer
from ._vectors import Vectors
from .fences import Fence
from .safetensors import Framework, LoadedTensors

__all__ = ["GpuDirectStorage"]

log = logging.getLogger("tiering.io")

P = ParamSpec("P")
R = TypeVar("R")


class GpuDirectStorage(Closing, AsyncTwins):
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
        # Ranks count directory tiers only: a memory tier above ``nvme`` must not make it
        # rank 1 and give its reads the slow tiers' few threads (``GdsConfig.io_for``).
        roots = [(t.name, Path(os.path.realpath(t.path))) for t in tiers or () if t.path]
        self._tiers = [(name, rank, root) for rank, (name, root) in enumerate(roots)]
        # Storages of several devices may share one Stats, for one snapshot of them all.
        self._stats = stats if stats is not None else Stats()
        self._pools = Pools(self.device, self.config)
        self._pinned = PinnedPool() if self.device.is_cuda else None
        self._engine = Transfer(self.device, self.config, self._backend, self._stats, self._pools)
        self._vectors = Vectors(
            self.device, self.config, self._stats, self._pools, self._pinned, self._engine
        )
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

    # -- lifecycle -------------------------------------------------------------------------

    def _check_open(self) -> None:
        self._pools.check_open()

    def close(self) -> None:
        """Stop the storage's threads and free its staging memory. Idempotent."""
        self._pools.close()
        self._engine.close()
        if self._pinned is not None:
            self._pinned.clear()

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
        return open_gds_file(
            path,
            fd,
            device=self.device,
            config=self.config,
            chosen=self._chosen,
            tier_of=self.tier_of,
            owner=self,
        )

    def _own(self, file: GdsFile) -> None:
        if not isinstance(file, GdsFile):
            raise InvalidInput(f"expected a GdsFile from open_file(), got {type(file).__name__}")
        if file._owner is not self:
            raise InvalidInput("this GdsFile was opened by another GpuDirectStorage")

    def open_source(self, source: Source, *, tier: str | None, rank: int | None) -> GdsFile:
        """Open a file that has no local descriptor (an object-store tier's
        :class:`~tiering.tiers.Source`) for every read :meth:`open_file` files get.

        Its reads take the ``remote`` I/O path (:mod:`tiering.io._remote`) through the
        source's :class:`~tiering.ranges.RangeReader` (``source.ranges``): ranged reads
        straight into host memory, or through pinned staging pieces into GPU memory; they
        are counted under ``tier``. The file owns ``source`` and closes it when closed. A
        source with no reader (a local file) is an :class:`~tiering.errors.InvalidInput`:
        open it with :meth:`open_file`.
        """
        self._check_open()
        ranges = source.ranges
        if ranges is None:
            raise InvalidInput(f"{source.relpath} is a local file: open it with open_file()")
        return RemoteFile(
            source,
            ranges,
            name=source.relpath,
            tier=tier,
            rank=rank,
            alignment=self.config.alignment,
            owner=self,
        )

    def open_copy(
        self,
        array: Any,
        held_on: Device,
        *,
        name: str,
        tier: str | None,
        rank: int | None,
        on_close: Callable[[], None] | None = None,
        head: bytes = b"",
    ) -> GdsFile:
        """Open bytes already held in memory (flat ``uint8`` ``array``, on the host or on GPU
        ``held_on``, after the file's first bytes ``head`` where the array is not the whole
        file) for every read :meth:`open_file` files get.

        Reads are memory copies under the ``copy`` I/O path (see :mod:`tiering.io._copies`),
        counted under ``tier`` (where the file's authoritative bytes are). The holder must keep
        ``array`` unchanged until ``on_close`` is called, when the file is closed and its last
        read has ended.
        """
        self._check_open()
        return CopyFile(
            array,
            held_on,
            name=name,
            tier=tier,
            rank=rank,
            alignment=self.config.alignment,
            owner=self,
            target=self.device,
            on_close=on_close,
            head=head,
        )

    # -- the transfer primitives, for shard and replica loads (see ShardStorage) -------------

    def transfer_ranges(
        self,
        file: GdsFile,
        fd: int,
        dst: Any,
        reads: Sequence[tuple[int, int, int]],
        fence: Fence | None = None,
    ) -> IoReport:
        """Read each ``(file_offset, nbytes, dst_offset)`` of ``file`` into flat uint8 ``dst``
        on this storage's device, at once where the engine can, queueing the copies on
        ``fence`` if given. ``fd`` is the file's descriptor from ``with file.guard() as fd``,
        held across the calls of one load."""
        return self._engine.transfer_ranges(file, fd, dst, reads, fence)

    def fan_out(self, fn: Callable[..., R], calls: Sequence[tuple[Any, ...]]) -> list[R]:
        """``[fn(*args) for args in calls]``, concurrently on this storage's I/O threads."""
        return self._pools.fan_out(fn, calls)

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
        flat = flat_target(self.device, buffer)
        check_range(file, offset, flat.nbytes)
        check_alignment(self.config, self.device, int(offset), flat.nbytes, flat)
        with file.guard() as fd:
            return self._engine.transfer(file, fd, flat, 0, int(offset), flat.nbytes)

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
        dt = parse_dtype(dtype)
        n = check_range(file, offset, length)
        if n % dt.itemsize:
            raise InvalidDtype(
                f"{n} bytes is not a whole number of {dt} items ({dt.itemsize} bytes each)",
                dtype=str(dt),
                length=n,
            )
        with file.guard() as fd:
            out = self.device.empty(n)
            report = self._engine.transfer(file, fd, out, 0, int(offset), n)
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
            results = self._pools.fan_out(self.read, [(f,) for f in files])
        finally:
            for f in files:
                f.close()
        return BatchResult(
            {k: r.array for k, r in zip(keys, results, strict=True)},
            {k: r.report for k, r in zip(keys, results, strict=True)},
        )

    # -- public API: vectors ---------------------------------------------------------------

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
        return self._vectors.read(file, start, count, dim, dtype)

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
        return self._vectors.prefetch(file, indices, dim, dtype, buffer)

    def gather(self, file: GdsFile, indices: Any, dim: int, dtype: Any = np.float32) -> ReadResult:
        """Like :meth:`prefetch_vectors`, into a new ``(len(indices), dim)`` array."""
        self._own(file)
        return self._vectors.gather(file, indices, dim, dtype)

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
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        return load_shards(self, list(paths), names, framework)

    def load_safetensors_raw(
        self,
        files: Sequence[str | os.PathLike[str] | GdsFile],
        names: Iterable[str] | None = None,
        allocate: Callable[[int], Any] | None = None,
        fence: Fence | None = None,
        transfer: TransferRanges | None = None,
    ) -> list[ShardLayout]:
        """Like :meth:`load_safetensors`, but return each shard's allocation and layout.

        For callers that own the memory (tierd's service hands it to another process):
        ``allocate(nbytes)`` must return a flat ``uint8`` array on this storage's device, and
        is called once per shard, only after every header has been read and checked. Open
        :class:`GdsFile` items are read as they are and left open. Copies of bytes held in
        memory may leave their wait to ``fence`` (the caller seals it; see
        :mod:`tiering.io.fences`); every other read has landed on return. ``transfer``
        (``transfer(file, fd, dst, reads, fence)``) makes each shard's reads in place of
        :meth:`transfer_ranges`, which it may call.

        Raises
        ------
        MalformedFile, InvalidDtype, InvalidInput, FileNotFound
        """
        return load_shards_raw(self, list(files), names, allocate, fence, transfer)

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
        return _write.write_buffer(
            self._backend, self._stats, buffer, path, tier_of=self.tier_of, overwrite=overwrite
        )

    # -- stats -----------------------------------------------------------------------------

    def stats(self) -> GdsStatsSnapshot:
        """A snapshot of the counters, in total, per I/O path and per tier."""
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        """Zero the counters."""
        self._stats.reset()

    def __repr__(self) -> str:
        return (
            f"<GpuDirectStorage device={self.device} backend={self.backend} "
            f"gds={self.gds_available}>"
        )
