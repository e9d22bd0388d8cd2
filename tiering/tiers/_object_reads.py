"""How a promotion reads an object in order: ranged GETs by botocore, or by KvikIO's RemoteFile.

A promotion reads the whole object in order into a ring of host buffers (see
:meth:`~tiering.tiers.ObjectSource.chunks`). With botocore each ranged GET holds a Python
thread: 64 of them contend for the GIL with the one thread that hashes and writes the file,
and the promotion stopped near 0.6 GB/s on the H100 machine where the same origin gave KvikIO
7 GB/s (issue 17). libcurl's threads hold no GIL, so the consumer keeps a core to itself.

KvikIO knows no AWS credentials: the source presigns a GET URL with boto3 (any link of the
AWS chain, any S3-protocol store), and KvikIO opens it as plain HTTP. It cannot send
``If-Match``; the mover HEADs the key after the copy (``Source.unchanged``) and drops the temp
if the ETag moved, as it does for a directory tier's changed inode.

``engine``: ``"auto"`` uses KvikIO where it is installed with remote I/O, else botocore;
``"kvikio"`` requires it; ``"boto3"`` never uses it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["ENGINES", "Blocks", "BotoBlocks", "KvikioBlocks", "Rings", "kvikio_remote"]

log = logging.getLogger(__name__)

ENGINES = ("auto", "kvikio", "boto3")

_lock = threading.Lock()
_state: dict[str, Any] = {}


def kvikio_remote(engine: str, threads: int) -> ModuleType | None:
    """KvikIO when ``engine`` allows it and it has remote I/O, with its pool grown to at least
    ``threads`` (never shrunk: other readers in the process may rely on it); else None.

    ``engine="kvikio"`` without it raises :class:`ImportError`, naming why.
    """
    if engine not in ENGINES:
        raise ValueError(f"read engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    if engine == "boto3":
        return None
    with _lock:
        if "module" not in _state:
            try:
                kvikio = importlib.import_module("kvikio")
                remote = importlib.import_module("kvikio.remote_file")
                if not remote.is_remote_file_available():
                    raise ImportError("this KvikIO was built without remote I/O (libcurl)")
                _state["module"] = kvikio
            except ImportError as exc:
                _state["module"] = None
                _state["why"] = str(exc)
                log.info("object tiers read with botocore (KvikIO: %s)", exc)
        kvikio = _state["module"]
        if kvikio is None:
            if engine == "kvikio":
                raise ImportError(f"read engine 'kvikio' is not usable here: {_state['why']}")
            return None
        defaults = importlib.import_module("kvikio.defaults")
        # One ranged GET per pool thread: fewer threads than connections would cap the reads.
        if int(defaults.get("num_threads")) < threads:
            defaults.set({"num_threads": threads})
        return kvikio  # type: ignore[no-any-return]


class Rings:
    """Read-ahead buffers kept between promotions, up to ``limit`` bytes.

    A fresh ring costs more than its reads: on the H100 machine 520 MiB of new ``bytearray``
    (zeroed, then faulted in by 64 reader threads contending for one address space) held a
    KvikIO promotion's reads to 2.3 GB/s. The buffers of the last ring are kept for the next
    promotion, so an object tier holds about ``readahead_bytes`` once it has promoted a file;
    a second promotion at the same time makes its own, dropped after it.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, count: int, size: int) -> list[bytearray]:
        with self._lock:
            mine = [b for b in self._free if len(b) == size][:count]
            for b in mine:
                self._free.remove(b)
        return mine + [bytearray(size) for _ in range(count - len(mine))]

    def give(self, bufs: list[bytearray]) -> None:
        with self._lock:
            kept = sum(len(b) for b in self._free)
            for b in bufs:
                if kept + len(b) > self.limit:
                    break
                self._free.append(b)
                kept += len(b)


class Blocks:
    """How :meth:`ObjectSource.chunks` reads one block: ``read`` starts it, ``wait`` ends it,
    ``drain`` ends every block still in flight (a block must not land in a dropped buffer)."""

    def read(self, view: memoryview, offset: int) -> Any:
        raise NotImplementedError

    def wait(self, handle: Any, n: int, offset: int) -> None:
        raise NotImplementedError

    def drain(self, inflight: deque[tuple[Any, int, int]]) -> None:
        for handle, n, offset in inflight:
            with contextlib.suppress(Exception):
                self.wait(handle, n, offset)

    def close(self) -> None:
        pass


class BotoBlocks(Blocks):
    """Ranged GETs on the tier's pool: ``get_into(view, offset)`` fills ``view`` from
    ``offset`` at the ETag opened (``If-Match``, retries, resumed bodies)."""

    def __init__(self, get_into: Callable[[memoryview, int], None], pool: Executor) -> None:
        self.get_into, self.pool = get_into, pool

    def read(self, view: memoryview, offset: int) -> Future[None]:
        return self.pool.submit(self.get_into, view, offset)

    def wait(self, handle: Any, n: int, offset: int) -> None:
        handle.result()

    def drain(self, inflight: deque[tuple[Any, int, int]]) -> None:
        for handle, _, _ in inflight:
            handle.cancel()
        wait([h for h, _, _ in inflight])


class KvikioBlocks(Blocks):
    """Ranged reads by KvikIO's ``RemoteFile`` over a presigned URL.

    libcurl retries only some HTTP statuses, and a connection reset or a body cut short fails
    the read. Such a block is read again by botocore (``fallback``: its retries, a resumed
    body, and ``If-Match``, so a replaced object is a :class:`~tiering.errors.FileChanged`),
    so a promotion survives what the botocore path survives.
    """

    def __init__(self, kvikio: ModuleType, url: str, size: int, fallback: BotoBlocks) -> None:
        self._file = kvikio.RemoteFile.open_http(url, nbytes=size)
        self.fallback = fallback

    def read(self, view: memoryview, offset: int) -> Any:
        arr = np.frombuffer(view, dtype=np.uint8)
        return (self._file.pread(arr, arr.nbytes, offset), view)

    def wait(self, handle: Any, n: int, offset: int) -> None:
        future, view = handle
        try:
            got = int(future.get())
        except Exception as exc:  # libcurl's failures come as RuntimeError
            log.info("KvikIO read at offset %d failed (%s); reading it with botocore", offset, exc)
            got = -1
        if got != n:
            self.fallback.get_into(view, offset)

    def drain(self, inflight: deque[tuple[Any, int, int]]) -> None:
        for (future, _), _, _ in inflight:
            with contextlib.suppress(Exception):
                future.get()

    def close(self) -> None:
        self._file.close()
