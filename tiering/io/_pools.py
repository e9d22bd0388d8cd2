"""The thread pools of one storage, and whether it is still open.

Each :class:`TierIo` setting gets its own pool (its thread count is that tier's concurrency);
a few auxiliary pools run whole calls: ``batch`` (files of one batch, shards of one load),
``async`` (the ``a``-prefixed twins), ``gather`` (vector gathers) and ``remote`` (ranged reads
of remote files; each may fan out further on its tier's own connections). Every pool is
created on first use and stopped by :meth:`Pools.close`, after which no new work is accepted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from tiering.errors import InvalidInput

from ._config import GdsConfig, TierIo
from ._device import Device

__all__ = ["AuxKind", "Pools"]

R = TypeVar("R")

AuxKind = Literal["batch", "async", "gather", "remote"]


class Pools:
    """A storage's pools; every thread starts with the storage's device current."""

    def __init__(self, device: Device, config: GdsConfig) -> None:
        self._device = device
        self._config = config
        self._lock = threading.Lock()
        self._io: dict[TierIo, ThreadPoolExecutor] = {}
        self._aux: dict[str, ThreadPoolExecutor] = {}
        self._closed = False

    def check_open(self) -> None:
        """Raise :class:`InvalidInput` once the storage is closed."""
        if self._closed:
            raise InvalidInput("this GpuDirectStorage is closed")

    def for_io(self, io: TierIo) -> ThreadPoolExecutor:
        """The pool that runs the chunks of reads with setting ``io``."""
        with self._lock:
            self.check_open()
            pool = self._io.get(io)
            if pool is None:
                pool = ThreadPoolExecutor(
                    max_workers=io.threads,
                    thread_name_prefix=f"tierd-io-{io.threads}x{io.task_size >> 10}k",
                    initializer=self._device.make_current,
                )
                self._io[io] = pool
            return pool

    def aux(self, kind: AuxKind) -> ThreadPoolExecutor:
        """The auxiliary pool ``kind``, sized by its setting in the config."""
        size = {
            "batch": self._config.max_concurrent_ops,
            "async": self._config.thread_pool_size,
            "gather": self._config.gather_threads,
            "remote": self._config.remote_threads,
        }[kind]
        with self._lock:
            self.check_open()
            pool = self._aux.get(kind)
            if pool is None:
                pool = ThreadPoolExecutor(
                    max_workers=size,
                    thread_name_prefix=f"tierd-{kind}",
                    initializer=self._device.make_current,
                )
                self._aux[kind] = pool
            return pool

    def fan_out(self, fn: Callable[..., R], calls: Sequence[tuple[Any, ...]]) -> list[R]:
        """``[fn(*args) for args in calls]``, concurrently on the ``batch`` pool.

        Waits for every call before raising the first error, so nothing is still writing into
        memory that the caller frees on the way out.
        """
        if len(calls) <= 1:
            return [fn(*args) for args in calls]
        pool = self.aux("batch")
        futures = [pool.submit(fn, *args) for args in calls]
        errors = [f.exception() for f in futures]
        for err in errors:
            if err is not None:
                raise err
        return [f.result() for f in futures]

    def close(self) -> None:
        """Refuse new work, then stop every pool, waiting for work in flight. Idempotent."""
        with self._lock:
            self._closed = True
            pools = [*self._io.values(), *self._aux.values()]
            self._io.clear()
            self._aux.clear()
        for pool in pools:
            pool.shutdown(wait=True)
