"""Loading safetensors shards through a :class:`GpuDirectStorage`: one allocation per shard,
shards in parallel, every header checked before anything is allocated.

This module sits below the storage that calls it: it asks only for the few members that
:class:`ShardStorage` names, so it never imports the storage's module (no import cycle).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from tiering.errors import InvalidInput

from ._copies import CopyFile
from ._device import Device
from ._file import GdsFile
from ._stats import IoReport
from .fences import Fence
from .safetensors import (
    DTYPES,
    LoadedTensors,
    SafetensorsHeader,
    TensorInfo,
    convert,
    parse_header,
    select_tensors,
)

__all__ = [
    "Allocate",
    "ShardLayout",
    "ShardStorage",
    "TransferRanges",
    "load_shards",
    "load_shards_raw",
]

R = TypeVar("R")


class ShardStorage(Protocol):
    """What loading shards needs of a storage; :class:`GpuDirectStorage` provides it."""

    device: Device

    def open_file(self, path: str | os.PathLike[str]) -> GdsFile:
        """Open a file for reading; the caller closes it."""
        ...

    def _own(self, file: GdsFile) -> None:
        """Raise unless ``file`` was opened by this storage."""
        ...

    def fan_out(self, fn: Callable[..., R], calls: Sequence[tuple[Any, ...]]) -> list[R]:
        """``[fn(*args) for args in calls]``, concurrently."""
        ...

    def transfer_ranges(
        self,
        file: GdsFile,
        fd: int,
        dst: Any,
        reads: Sequence[tuple[int, int, int]],
        fence: Fence | None = None,
    ) -> IoReport:
        """Read each ``(file_offset, nbytes, dst_offset)`` into flat uint8 ``dst``."""
        ...


TransferRanges = Callable[
    [GdsFile, int, Any, Sequence[tuple[int, int, int]], Fence | None], IoReport
]
"""``transfer(file, fd, dst, reads, fence)``: a shard's planned reads into its allocation, as
:meth:`ShardStorage.transfer_ranges` makes them; a caller may put its own in between (tierd's
service reads one file's same ranges once for concurrent loads, see
:mod:`tiering.serving.sharedreads`)."""


# Slot alignment inside a packed shard allocation: enough for any dtype and for coalescing.
_SLOT = 256
# Read the whole span between the first and last selected tensor when the selection fills at
# least this much of it: one large read beats many small ones, even with some waste. A remote
# file reads only the selected tensors (a gap costs network bytes, and its ranges are fetched
# concurrently anyway): its span is read whole only when nothing lies between them.
_SPAN_FILL = 0.5
_SPAN_FILL_REMOTE = 1.0


def _framework(storage: ShardStorage, framework: str) -> str:
    if framework == "auto":
        return "cupy" if storage.device.is_cuda else "numpy"
    if framework not in ("numpy", "cupy", "torch"):
        raise InvalidInput(f"framework must be auto, numpy, cupy or torch, got {framework!r}")
    if framework == "numpy" and storage.device.is_cuda:
        raise InvalidInput(f"framework='numpy' needs device cpu, not {storage.device}")
    if framework == "cupy" and not storage.device.is_cuda:
        raise InvalidInput("framework='cupy' needs a cuda device")
    if framework == "torch":
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            raise InvalidInput("framework='torch' needs torch installed") from exc
    return framework


def _plan(
    tensors: list[TensorInfo], span_fill: float = _SPAN_FILL
) -> tuple[list[tuple[int, int, int]], dict[str, int], int]:
    """Reads ``(file_offset, nbytes, dst_offset)``, tensor → dst offset, allocation size."""
    if not tensors:
        return [], {}, 0
    tensors = sorted(tensors, key=lambda t: t.begin)
    lo, hi = tensors[0].begin, max(t.end for t in tensors)
    wanted = sum(t.nbytes for t in tensors)
    if hi - lo == 0 or wanted / (hi - lo) >= span_fill:
        return [(lo, hi - lo, 0)], {t.name: t.begin - lo for t in tensors}, hi - lo
    reads: list[tuple[int, int, int]] = []
    where: dict[str, int] = {}
    pos = 0
    for t in tensors:
        if reads and reads[-1][0] + reads[-1][1] == t.begin:
            # Adjacent in the file: extend the previous read; the slot follows on directly.
            f, n, d = reads[-1]
            where[t.name] = d + n
            reads[-1] = (f, n + t.nbytes, d)
            pos = d + n + t.nbytes
        else:
            pos = -(-pos // _SLOT) * _SLOT
            where[t.name] = pos
            reads.append((t.begin, t.nbytes, pos))
            pos += t.nbytes
    return reads, where, pos


def _view(storage: ShardStorage, buf: Any, at: int, t: TensorInfo) -> Any:
    raw = buf[at : at + t.nbytes]
    dt = np.dtype(DTYPES[t.dtype].storage)
    if at % dt.itemsize:
        # safetensors writers align tensors, but the format does not require it.
        raw = raw.copy()
    return raw.view(dt).reshape(t.shape)


@dataclass(frozen=True)
class ShardLayout:
    """One shard loaded into one allocation, by :meth:`GpuDirectStorage.load_safetensors_raw`.

    ``tensors`` maps each selected tensor to its byte offset in ``buffer`` (a flat ``uint8``
    array on the storage's device) and its header entry.
    """

    path: Path
    buffer: Any
    tensors: dict[str, tuple[int, TensorInfo]]
    report: IoReport


Allocate = Callable[[int], Any]
"""``allocate(nbytes)``: a flat ``uint8`` array of ``nbytes`` on the storage's device."""


def load_shards_raw(
    storage: ShardStorage,
    paths: Sequence[str | os.PathLike[str] | GdsFile],
    names: Iterable[str] | None,
    allocate: Allocate | None = None,
    fence: Fence | None = None,
    transfer: TransferRanges | None = None,
) -> list[ShardLayout]:
    """Read the selected tensors of each shard into one allocation per shard.

    Every header is read and checked before ``allocate`` is called. Open :class:`GdsFile`
    items are used as they are and left open; paths are opened and closed here. ``fence``:
    see :meth:`GpuDirectStorage.load_safetensors_raw`; ``transfer``: see :data:`TransferRanges`
    (default: the storage's own).
    """
    files: list[GdsFile] = []
    owned: list[GdsFile] = []
    try:
        headers: list[SafetensorsHeader] = []
        for p in paths:
            if isinstance(p, GdsFile):
                storage._own(p)
                f = p
            else:
                f = storage.open_file(p)
                owned.append(f)
            files.append(f)
            with f.guard():
                headers.append(parse_header(f.path, f.size(), f.read_bytes))
        chosen = [set(picked) for picked in select_tensors(headers, names)]
        jobs = [
            (f, h, [t for n, t in h.tensors.items() if n in picked])  # in file order
            for f, h, picked in zip(files, headers, chosen, strict=True)
        ]
        alloc: Allocate = allocate or storage.device.empty
        move = transfer or storage.transfer_ranges
        load = _loader(alloc, fence, move)
        if all(isinstance(f, CopyFile) and f.held_on.is_cuda for f in files):
            # Copies on the device: each shard's job is an allocation and a queued copy of
            # microseconds, and handing the jobs to the I/O threads cost more than the jobs (a
            # restarted engine's load of 3 kept shards on the H200: about 3 ms of the server's 4).
            return [load(j) for j in jobs]
        return storage.fan_out(load, [(j,) for j in jobs])
    finally:
        for f in owned:
            f.close()


def load_shards(
    storage: ShardStorage,
    paths: list[str | os.PathLike[str]],
    names: Iterable[str] | None,
    framework: str,
) -> LoadedTensors:
    fw = _framework(storage, framework)
    shards = load_shards_raw(storage, paths, names)
    tensors: dict[str, Any] = {}
    dtypes: dict[str, str] = {}
    reports: dict[Path, IoReport] = {}
    for shard in shards:
        reports[shard.path] = shard.report
        for name, (at, t) in sorted(shard.tensors.items(), key=lambda kv: kv[1][1].begin):
            tensors[name] = convert(_view(storage, shard.buffer, at, t), t.dtype, fw)
            dtypes[name] = t.dtype
    return LoadedTensors(tensors, dtypes, reports)


def _loader(allocate: Allocate, fence: Fence | None, transfer: TransferRanges) -> Any:
    """The per-shard job: one allocation, the planned reads into it."""

    def load_one(job: tuple[GdsFile, SafetensorsHeader, list[TensorInfo]]) -> ShardLayout:
        f, h, selected = job
        reads, where, total = _plan(
            selected, _SPAN_FILL_REMOTE if f.io_path == "remote" else _SPAN_FILL
        )
        buf = allocate(total)
        with f.guard() as fd:
            report = transfer(f, fd, buf, reads, fence)
        return ShardLayout(h.path, buf, {t.name: (where[t.name], t) for t in selected}, report)

    return load_one
