"""A file's bytes in order with reads in flight ahead of the consumer: a promotion's reader.

A promotion reads the whole file in order into a ring of host buffers while one thread hashes
and writes what has landed. Any :class:`~tiering.ranges.RangeReader` does: an object store's
ranged GETs on its pool, or KvikIO's ``RemoteFile`` (whose libcurl threads leave the GIL to
that one consumer: with 64 botocore threads the promotion stopped near 0.6 GB/s on the H100
machine where the same origin gave KvikIO 7 GB/s, issue 17).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator

from tiering.ranges._reader import Pending, RangeReader

__all__ = ["Rings", "read_ahead"]


class Rings:
    """Read-ahead buffers kept between promotions, up to ``limit`` bytes.

    A fresh ring costs more than its reads: on the H100 machine 520 MiB of new ``bytearray``
    (zeroed, then faulted in by 64 reader threads contending for one address space) held a
    KvikIO promotion's reads to 2.3 GB/s. The buffers of the last ring are kept for the next
    promotion, so a source holds about its read-ahead once it has promoted a file; a second
    promotion at the same time makes its own, dropped after it.
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


def read_ahead(
    reader: RangeReader, chunk_size: int, *, readahead_bytes: int, rings: Rings
) -> Iterator[memoryview]:
    """``reader``'s bytes from the start, in chunks of ``chunk_size``; a view is valid until
    the next one.

    Blocks are a whole number of chunks (at least one ``reader.part_size``), read into a ring
    of ``window + 1`` buffers: while the caller holds a chunk of block ``i``, blocks ``i+1``
    to ``i+window`` are being read into the other buffers.
    """
    size = reader.size
    if size == 0:
        return
    block = chunk_size * max(1, -(-reader.part_size // chunk_size))
    nblocks = -(-size // block)
    window = min(nblocks, max(2, readahead_bytes // block))
    ring = rings.take(min(nblocks, window + 1), min(block, size))
    inflight: deque[Pending] = deque()

    def fetch(i: int) -> None:
        start = i * block
        view = memoryview(ring[i % len(ring)])[: min(block, size - start)]
        inflight.append(reader.start(view, start))

    try:
        for i in range(window):
            fetch(i)
        for i in range(nblocks):
            inflight.popleft().result()
            if i + window < nblocks:
                fetch(i + window)
            length = min(block, size - i * block)
            view = memoryview(ring[i % len(ring)])[:length]
            for off in range(0, length, chunk_size):
                yield view[off : off + chunk_size]
    finally:
        # No read may still be writing into a buffer once it goes back to the rings.
        for pending in inflight:
            pending.cancel()
        for pending in inflight:
            with contextlib.suppress(Exception):
                pending.result()
        rings.give(ring)
