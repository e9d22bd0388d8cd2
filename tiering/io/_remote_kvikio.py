"""Remote reads through KvikIO's ``RemoteFile``: libcurl on KvikIO's C++ thread pool, straight
into the destination (GPU memory through KvikIO's own bounce buffers, host memory directly).

A Python data plane stops near 2 GB/s; KvikIO's ``RemoteFile`` reads an S3-like origin at
7 GB/s and more from the same process (see issue 17). :class:`~tiering.io._remote.RemoteReads`
hands a call here when the file's source can presign (:class:`Presignable`, an object-store
tier's source) and KvikIO is installed with remote I/O.

- **Authentication.** The source presigns a GET URL with boto3, so every credential source of
  the AWS chain and every S3-protocol store works; KvikIO opens it as plain HTTP
  (``RemoteFile.open_http(url, nbytes=size)``: no request before the first read). One handle
  per :class:`~tiering.io._remote.RemoteFile`, presigned again when half its lifetime has
  passed, dropped when the file closes.
- **Consistency.** KvikIO cannot send ``If-Match``. The source was opened at the catalog's
  ETag; after the last range has landed the source HEADs the key again
  (:meth:`Presignable.check_unchanged`), and a changed ETag or size raises
  :class:`~tiering.errors.FileChanged`: the caller discards the buffer, as it does when an
  ``If-Match`` GET fails. Where the bucket keeps versions, the URL names the version opened and
  the bytes are exactly those.
- **Threads.** KvikIO's pool and ``task_size`` are one per process. The pool is grown to
  ``remote_kvikio_threads`` (never shrunk: a storage whose backend is KvikIO grows it through
  that backend, which then hands its local reads fewer, larger tasks so that they keep their
  own concurrency); ``task_size`` is raised to ``remote_kvikio_task_size`` (local reads pass
  their own task size).
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tiering.errors import BackendUnavailable, IntegrityError

from ._backends import KVIKIO_HINT, _DevPtr, _host_view
from ._config import GdsConfig

__all__ = ["KvikioFailed", "KvikioHandle", "KvikioRemote", "Presignable"]

log = logging.getLogger("tiering.io")


@runtime_checkable
class Presignable(Protocol):
    """A source that other engines can read by URL (:class:`~tiering.tiers.ObjectSource`)."""

    def url(self, expires_s: int) -> str:
        """A presigned GET URL of the bytes opened, valid for ``expires_s`` seconds."""

    def check_unchanged(self) -> None:
        """Raise :class:`~tiering.errors.FileChanged` if the bytes opened were replaced."""


class KvikioFailed(Exception):
    """A KvikIO remote read failed for a reason other than a changed object."""


class KvikioHandle:
    """The KvikIO handle of one remote file (opened at its first KvikIO read), and when its
    presigned URL is renewed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.remote: Any = None
        self.renew_at = 0.0

    def drop(self) -> None:
        """Forget the handle (when the file closes)."""
        with self.lock:
            if self.remote is not None:
                self.remote.close()
            self.remote = None


class KvikioRemote:
    """KvikIO's ``RemoteFile`` for the remote reads of one storage (see the module docstring).

    ``grow_pool(threads)`` grows KvikIO's pool where the storage's backend owns it
    (:meth:`~tiering.io._backends.KvikioBackend.ensure_pool`); without it the pool is grown
    here.
    """

    def __init__(self, config: GdsConfig, grow_pool: Callable[[int], None] | None) -> None:
        self.mode = config.remote_backend
        self.threads = config.remote_kvikio_threads
        self.task_size = config.remote_kvikio_task_size
        self.min_bytes = config.remote_kvikio_min_bytes if self.mode == "auto" else 0
        self.expires_s = config.remote_url_expires_s
        self._grow = grow_pool
        self._lock = threading.Lock()
        self._kvikio: ModuleType | None = None
        self._why_not: str | None = None
        if self.mode == "kvikio":
            self._load()

    @property
    def strict(self) -> bool:
        """KvikIO was asked for by name: its failures are errors, not fallbacks."""
        return self.mode == "kvikio"

    def usable(self, source: object, nbytes: int) -> Presignable | None:
        """``source`` when a read of ``nbytes`` from it goes through KvikIO, else None."""
        if self.mode == "python" or nbytes < self.min_bytes:
            return None
        if not isinstance(source, Presignable):
            return None
        return source if self._load() is not None else None

    def _load(self) -> ModuleType | None:
        with self._lock:
            if self._kvikio is not None or self._why_not is not None:
                return self._kvikio
            try:
                kvikio = importlib.import_module("kvikio")
                remote = importlib.import_module("kvikio.remote_file")
                defaults = importlib.import_module("kvikio.defaults")
                if not remote.is_remote_file_available():
                    raise ImportError("this KvikIO was built without remote I/O (libcurl)")
            except ImportError as exc:
                if self.strict:
                    raise BackendUnavailable(
                        f"remote_backend='kvikio' needs KvikIO with remote I/O: {exc}; "
                        f"{KVIKIO_HINT}"
                    ) from exc
                self._why_not = str(exc)
                log.info("tiering.io: remote reads use ranged GETs from Python (%s)", exc)
                return None
            if self._grow is not None:
                self._grow(self.threads)
            elif int(defaults.get("num_threads")) < self.threads:
                defaults.set({"num_threads": self.threads})
            if int(defaults.get("task_size")) < self.task_size:
                defaults.set({"task_size": self.task_size})
            log.info(
                "tiering.io: remote reads use KvikIO RemoteFile (%d threads x %d MiB)",
                int(defaults.get("num_threads")),
                int(defaults.get("task_size")) >> 20,
            )
            self._kvikio = kvikio
            return kvikio

    def _remote(self, file: Any, source: Presignable) -> Any:
        """The file's KvikIO handle, opened (or presigned again) when needed."""
        state: KvikioHandle = file.kvikio
        with state.lock:
            now = time.monotonic()
            if state.remote is None or now >= state.renew_at:
                url = source.url(self.expires_s)  # FileChanged if replaced since the open
                assert self._kvikio is not None
                try:
                    state.remote = self._kvikio.RemoteFile.open_http(url, nbytes=file.size())
                except Exception as exc:
                    raise KvikioFailed(f"KvikIO could not open the URL: {exc}") from exc
                state.renew_at = now + self.expires_s / 2
            return state.remote

    def read(self, file: Any, source: Presignable, dst: Any, segments: Sequence[Any]) -> None:
        """Every ``(file_offset, nbytes, dst_offset)`` of ``file`` into flat uint8 ``dst``.

        Raises :class:`~tiering.errors.FileChanged` when the object was replaced (whatever
        else failed), :class:`KvikioFailed` for any other failure of KvikIO. No range is still
        being written into ``dst`` when it returns or raises.
        """
        remote = self._remote(file, source)
        host = isinstance(dst, np.ndarray)
        flat = np.frombuffer(_host_view(dst), dtype=np.uint8) if host else None
        futures: list[tuple[int, int, Any]] = []
        failure: BaseException | None = None
        try:
            for off, n, at in segments:
                if n <= 0:
                    continue
                buf = flat[at : at + n] if flat is not None else _DevPtr(dst, at, n)
                futures.append((off, n, remote.pread(buf, n, off)))
        except Exception as exc:
            failure = exc
        for off, n, fut in futures:  # every one, even after a failure: none may still write
            try:
                got = int(fut.get())
            except Exception as exc:
                failure = failure or exc
                continue
            if got != n and failure is None:
                failure = IntegrityError(
                    f"{file.path}: only {got} of {n} bytes at offset {off} could be read",
                    offset=off,
                )
        source.check_unchanged()  # the bytes are in: were they the ones opened?
        if failure is not None:
            raise KvikioFailed(f"{type(failure).__name__}: {failure}") from failure
