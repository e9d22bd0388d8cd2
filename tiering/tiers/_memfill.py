"""Copying a whole file from its tier into host memory, hashing it on the way.

A local file is read by a few threads at once (each ``preadv`` leaves the GIL, and one thread
rarely keeps an NVMe drive busy) straight into the destination array, while the calling thread
hashes the chunks in order as they land. Another source (an object) is read in order through
its own read-ahead (:meth:`~tiering.tiers.Source.chunks`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from tiering.errors import IntegrityError
from tiering.tiers._base import Source

if TYPE_CHECKING:
    from tiering.checksum import Hasher

__all__ = ["FillCancelled", "read_whole"]

CHUNK = 16 << 20
#: A local file at least this big is read by several threads.
PARALLEL_MIN = 64 << 20
THREADS = 4


class FillCancelled(Exception):
    """The fill was asked to stop (a cancelled job, the engine stopping); nothing is kept."""


def read_whole(
    source: Source,
    out: np.ndarray,
    *,
    cancel: threading.Event | None = None,
    throttle: Callable[[int], None] | None = None,
    progress: Callable[[int], None] | None = None,
    chunk: int = CHUNK,
    threads: int = THREADS,
) -> str:
    """Read all of ``source`` into flat ``uint8`` ``out`` (its exact size); return tierd's
    checksum of the bytes read.

    ``throttle(n)`` is called before each chunk (a bandwidth cap may wait there),
    ``progress(n)`` after it. Raises :class:`FillCancelled` when ``cancel`` is set between
    chunks, and :class:`~tiering.errors.IntegrityError` when the file is not ``out.nbytes``
    long (it changed during the copy).
    """
    from tiering.checksum import Hasher  # xxhash: the client imports tiers without it

    hasher = Hasher()
    view = out.data.cast("B")
    size = len(view)
    local = source.local_file() is not None  # cheap positioned reads: no read-ahead needed
    if local and size >= PARALLEL_MIN and threads > 1:
        _parallel(source, view, hasher, cancel, throttle, progress, chunk, threads)
    elif local:
        pos = 0
        while pos < size:
            _check(cancel)
            n = min(chunk, size - pos)
            if throttle is not None:
                throttle(n)
            got = source.readinto(view[pos : pos + n], pos)
            if got != n:
                raise _short(source, pos + got, size)
            hasher.update(view[pos : pos + n])
            pos += n
            if progress is not None:
                progress(n)
    else:
        pos = 0
        for piece in source.chunks(chunk):
            _check(cancel)
            n = len(piece)
            if pos + n > size:
                raise _short(source, pos + n, size)
            if throttle is not None:
                throttle(n)
            view[pos : pos + n] = piece
            hasher.update(piece)
            pos += n
            if progress is not None:
                progress(n)
        if pos != size:
            raise _short(source, pos, size)
    # A cancel that came while the last chunk was read still stops the fill: nothing is kept.
    _check(cancel)
    return hasher.value()


def _parallel(
    source: Source,
    view: memoryview,
    hasher: Hasher,
    cancel: threading.Event | None,
    throttle: Callable[[int], None] | None,
    progress: Callable[[int], None] | None,
    chunk: int,
    threads: int,
) -> None:
    size = len(view)
    offsets = deque(range(0, size, chunk))
    pending: deque[tuple[int, int, Future[int]]] = deque()

    def submit(pool: ThreadPoolExecutor) -> None:
        off = offsets.popleft()
        n = min(chunk, size - off)
        if throttle is not None:
            throttle(n)
        pending.append((off, n, pool.submit(source.readinto, view[off : off + n], off)))

    with ThreadPoolExecutor(threads, thread_name_prefix="tierd-memfill") as pool:
        try:
            # A window of twice the threads: readers never wait for the hash to catch up.
            while offsets and len(pending) < 2 * threads:
                submit(pool)
            while pending:
                _check(cancel)
                off, n, fut = pending.popleft()
                got = fut.result()
                if got != n:
                    raise _short(source, off + got, size)
                hasher.update(view[off : off + n])
                if progress is not None:
                    progress(n)
                if offsets:
                    submit(pool)
        finally:
            for _off, _n, fut in pending:
                fut.cancel()


def _check(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise FillCancelled


def _short(source: Source, got: int, size: int) -> IntegrityError:
    return IntegrityError(
        f"{source.relpath!r} is not {size} bytes long any more (read {got}): it changed "
        "during the copy into memory",
        path=source.relpath,
    )
