"""KvikIO's ``RemoteFile`` over a :class:`~tiering.ranges.RangeReader`'s URL, in one place.

A Python data plane stops near 2 GB/s; KvikIO's ``RemoteFile`` reads an S3-like origin at
7 GB/s and more from the same process (issue 17): libcurl on KvikIO's C++ thread pool, without
the GIL, straight into the destination (GPU memory through KvikIO's own bounce buffers, host
memory directly). A promotion's read-ahead keeps the GIL for the one thread that hashes and
writes the file.

- **Where it wins** is decided once, by :meth:`KvikioReads.wins`: the mode allows it, the
  read is large enough (``min_bytes``), the reader serves a URL, and KvikIO is installed with
  remote I/O.
- **Authentication.** KvikIO knows no credentials: the reader hands out a URL (an object store
  presigns a GET with boto3, so every link of the AWS chain and every S3-protocol store works)
  and KvikIO opens it as plain HTTP (``RemoteFile.open_http(url, nbytes=size)``: no request
  before the first read). :class:`KvikioRanges` opens it at its first read and presigns again
  when half its lifetime has passed.
- **Consistency.** KvikIO cannot send ``If-Match``. After the last range has landed the caller
  asks the reader (:meth:`~tiering.ranges.RangeReader.check_unchanged`); a replaced object is
  :class:`~tiering.errors.FileChanged`. Where the bucket keeps versions the URL names the
  version opened.
- **Threads.** KvikIO's pool and ``task_size`` are one per process. The pool is grown to the
  caller's ``threads`` (never shrunk: other readers in the process rely on it), through
  ``grow`` where a storage's backend owns it; ``task_size`` is raised to ``task_size``.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal

import numpy as np

from tiering.ranges._reader import Pending, RangeReader

__all__ = ["KvikioFailed", "KvikioMode", "KvikioRanges", "KvikioReads"]

log = logging.getLogger(__name__)

KvikioMode = Literal["auto", "kvikio", "never"]
"""``auto``: KvikIO where it wins; ``kvikio``: required (its failures are errors); ``never``."""
_MODES = ("auto", "kvikio", "never")

_lock = threading.Lock()
_found: dict[str, Any] = {}  # "module": KvikIO with remote I/O or None, "why": why not


class KvikioFailed(Exception):
    """A KvikIO remote read failed for a reason other than a changed object."""


def _import() -> ModuleType:
    """KvikIO with remote I/O, or :class:`ImportError` naming why (found out once)."""
    with _lock:
        if "module" not in _found:
            try:
                kvikio = importlib.import_module("kvikio")
                remote = importlib.import_module("kvikio.remote_file")
                if not remote.is_remote_file_available():
                    raise ImportError("this KvikIO was built without remote I/O (libcurl)")
                _found["module"] = kvikio
            except ImportError as exc:
                _found["module"], _found["why"] = None, str(exc)
                log.info("remote reads use tierd's ranged GETs (KvikIO: %s)", exc)
        if _found["module"] is None:
            raise ImportError(_found["why"])
        return _found["module"]  # type: ignore[no-any-return]


class KvikioReads:
    """Whether KvikIO reads a reader's ranges, and with how many threads (see the module).

    ``mode="kvikio"`` without KvikIO raises :class:`ImportError` here, naming why.
    """

    def __init__(
        self,
        mode: KvikioMode,
        *,
        threads: int,
        expires_s: int,
        task_size: int = 0,
        min_bytes: int = 0,
        grow: Callable[[int], None] | None = None,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"KvikIO mode must be one of {', '.join(_MODES)}, not {mode!r}")
        self.mode = mode
        self.threads = threads
        self.expires_s = expires_s
        self.task_size = task_size
        self.min_bytes = min_bytes if mode == "auto" else 0
        self._grow = grow
        self._lock = threading.Lock()
        self._kvikio: ModuleType | None = None
        self._why_not: str | None = None
        if mode == "kvikio":
            self.load()

    @property
    def strict(self) -> bool:
        """KvikIO was asked for by name: its failures are errors, not fallbacks."""
        return self.mode == "kvikio"

    def wins(self, reader: RangeReader | None, nbytes: int) -> bool:
        """Whether a read of ``nbytes`` from ``reader`` goes through KvikIO."""
        if self.mode == "never" or nbytes < self.min_bytes:
            return False
        if reader is None or not reader.serves_url:
            return False
        return self.load() is not None

    def open(self, reader: RangeReader) -> KvikioRanges:
        """``reader``'s bytes through KvikIO (after :meth:`wins` said so)."""
        kvikio = self.load()
        assert kvikio is not None, "open() after wins()"
        return KvikioRanges(kvikio, reader, self.expires_s)

    def load(self) -> ModuleType | None:
        """KvikIO, its pool grown to :attr:`threads` at the first call; None without it."""
        with self._lock:
            if self._kvikio is not None or self._why_not is not None:
                return self._kvikio
            try:
                kvikio = _import()
            except ImportError as exc:
                if self.strict:
                    raise
                self._why_not = str(exc)
                return None
            defaults = importlib.import_module("kvikio.defaults")
            # One ranged GET per pool thread: fewer threads than connections would cap reads.
            if self._grow is not None:
                self._grow(self.threads)
            elif int(defaults.get("num_threads")) < self.threads:
                defaults.set({"num_threads": self.threads})
            if self.task_size and int(defaults.get("task_size")) < self.task_size:
                defaults.set({"task_size": self.task_size})
            log.info(
                "remote reads use KvikIO RemoteFile (%d threads x %d MiB)",
                int(defaults.get("num_threads")),
                int(defaults.get("task_size")) >> 20,
            )
            self._kvikio = kvikio
            return kvikio


class KvikioRanges(RangeReader):
    """``inner``'s bytes read by KvikIO's ``RemoteFile`` over the URL ``inner`` hands out.

    :meth:`pread` reads into any buffer KvikIO takes (host or device) and leaves failures to
    the caller. :meth:`get` and :meth:`start` (host memory) read a range that KvikIO failed
    (libcurl retries only some HTTP statuses; a reset or a body cut short fails the read)
    again through ``inner``: its retries, resumed bodies and pinning, so a replaced object is
    a :class:`~tiering.errors.FileChanged`.
    """

    serves_url = True

    def __init__(self, kvikio: ModuleType, inner: RangeReader, expires_s: int) -> None:
        super().__init__(
            inner.name, inner.size, inner.version, pool=inner.pool, part_size=inner.part_size
        )
        self.inner = inner
        self.expires_s = expires_s
        self._kvikio = kvikio
        self._lock = threading.Lock()
        self._remote: Any = None
        self._renew_at = 0.0

    def handle(self) -> Any:
        """KvikIO's ``RemoteFile``, opened (or presigned again) when needed: the one place a
        URL is asked for and opened. :class:`KvikioFailed` when KvikIO cannot open it;
        :class:`~tiering.errors.FileChanged` when the bytes were replaced since the open."""
        with self._lock:
            now = time.monotonic()
            if self._remote is None or now >= self._renew_at:
                url = self.inner.url(self.expires_s)
                try:
                    self._remote = self._kvikio.RemoteFile.open_http(url, nbytes=self.size)
                except Exception as exc:
                    raise KvikioFailed(f"KvikIO could not open the URL: {exc}") from exc
                self._renew_at = now + self.expires_s / 2
            return self._remote

    def pread(self, buf: Any, nbytes: int, offset: int) -> Any:
        """Start reading ``nbytes`` at ``offset`` into ``buf``: KvikIO's future (``get()``
        returns the bytes read, or raises)."""
        future = self.handle().pread(buf, nbytes, offset)
        self.inner.read_by_url(nbytes)
        return future

    def get(self, view: memoryview, offset: int) -> None:
        self.start(view, offset).result()

    def start(self, view: memoryview, offset: int) -> Pending:
        try:
            arr = np.frombuffer(view, dtype=np.uint8)
            return _Read(self.pread(arr, arr.nbytes, offset), view, offset, self.inner)
        except KvikioFailed as exc:  # a URL presigned again that KvikIO could not open
            log.info("%s: KvikIO failed (%s); reading it with tierd's GETs", self.name, exc)
            return self.inner.start(view, offset)

    def url(self, expires_s: int) -> str:
        return self.inner.url(expires_s)

    def check_unchanged(self) -> None:
        self.inner.check_unchanged()

    def close(self) -> None:
        with self._lock:
            if self._remote is not None:
                self._remote.close()
            self._remote = None


class _Read:
    """One range being read by KvikIO; :meth:`result` reads it again through ``fallback``
    when KvikIO failed, unless it was cancelled (its buffer is being dropped)."""

    def __init__(self, future: Any, view: memoryview, offset: int, fallback: RangeReader) -> None:
        self._future, self._view, self._offset = future, view, offset
        self._fallback = fallback
        self._cancelled = False

    def result(self, timeout: float | None = None) -> None:
        try:
            got = int(self._future.get())
        except Exception as exc:  # libcurl's failures come as RuntimeError
            log.info("KvikIO read at offset %d failed (%s); reading it again", self._offset, exc)
            got = -1
        if got != len(self._view) and not self._cancelled:
            self._fallback.get(self._view, self._offset)

    def cancel(self) -> bool:
        self._cancelled = True
        return False  # it has started: it still lands
