"""The ``async`` twins of :class:`~tiering.io.GpuDirectStorage`'s calls: each runs the call on
the storage's own ``async`` thread pool, so an event loop never blocks on I/O."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import numpy as np

from ._file import GdsFile
from ._pools import Pools
from ._results import BatchResult, ReadResult
from ._stats import IoReport
from .safetensors import Framework, LoadedTensors

__all__ = ["AsyncTwins"]

P = ParamSpec("P")
R = TypeVar("R")


class AsyncTwins:
    """``aopen_file``, ``aread`` ...: one ``async`` twin per blocking call of the storage."""

    if TYPE_CHECKING:
        _pools: Pools
        open_file: Callable[..., GdsFile]
        load_to_gpu: Callable[..., IoReport]
        read: Callable[..., ReadResult]
        load_file: Callable[..., ReadResult]
        load_models_batch: Callable[..., BatchResult]
        read_vectors: Callable[..., ReadResult]
        prefetch_vectors: Callable[..., IoReport]
        gather: Callable[..., ReadResult]
        load_safetensors: Callable[..., LoadedTensors]
        write_from_gpu: Callable[..., IoReport]

    async def _run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pools.aux("async"), functools.partial(fn, *args, **kwargs)
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
