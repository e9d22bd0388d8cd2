"""The range-read interface itself (:mod:`tiering.ranges`): what every source of remote bytes
gets from implementing :meth:`~tiering.ranges.RangeReader.get` (parallel reads, the read-ahead
of a promotion) and where KvikIO is chosen. The object store's reader is tested in
tests/tiers/test_object.py, KvikIO's reads on the GPU machine in tests/io/test_remote_kvikio.py.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor

import pytest

from tiering.ranges import KvikioReads, RangeReader, Rings, read_ahead

PART = 4096


class BytesRanges(RangeReader):
    """Ranges of ``data``; the ranges starting at an offset in ``fail_at`` raise."""

    def __init__(self, data: bytes, pool: Executor, fail_at: frozenset[int] = frozenset()):
        super().__init__("mem", len(data), "v1", pool=pool, part_size=PART)
        self.data, self.fail_at = data, fail_at
        self.gets: list[tuple[int, int]] = []
        self.threads: set[str] = set()
        self.finished = 0
        self._lock = threading.Lock()

    def get(self, view: memoryview, offset: int) -> None:
        assert offset >= 0 and offset + len(view) <= self.size
        with self._lock:
            self.gets.append((offset, len(view)))
            self.threads.add(threading.current_thread().name)
        try:
            if offset in self.fail_at:
                raise ConnectionError(f"range at {offset}")
            time.sleep(0.002)  # slower than the consumer: several ranges are in flight
            view[:] = self.data[offset : offset + len(view)]
        finally:
            with self._lock:
                self.finished += 1


@pytest.fixture
def pool() -> Iterator[Executor]:
    with ThreadPoolExecutor(4, thread_name_prefix="ranges") as p:
        yield p


def test_readinto_splits_long_ranges_into_parallel_parts_and_stops_at_the_end(
    pool: Executor,
) -> None:
    data = os.urandom(5 * PART + 7)
    reader = BytesRanges(data, pool)
    buf = bytearray(len(data))
    assert reader.readinto(memoryview(buf), 3) == len(data) - 3
    assert bytes(buf[: len(data) - 3]) == data[3:]
    n = len(data) - 3
    assert sorted(reader.gets) == [(3 + k * PART, min(PART, n - k * PART)) for k in range(6)]
    assert all(t.startswith("ranges") for t in reader.threads)
    assert reader.readinto(memoryview(bytearray(10)), len(data)) == 0
    small = bytearray(5)
    assert reader.readinto(memoryview(small), 1) == 5 and bytes(small) == data[1:6]


@pytest.mark.parametrize("size", [1, PART - 1, 3 * PART, 10 * PART + 123])
def test_read_ahead_yields_the_bytes_in_order_in_chunks(pool: Executor, size: int) -> None:
    data = os.urandom(size)
    rings = Rings(64 * PART)
    reader = BytesRanges(data, pool)
    ahead = read_ahead(reader, PART // 2, readahead_bytes=3 * PART, rings=rings)
    chunks = [bytes(c) for c in ahead]
    assert b"".join(chunks) == data
    assert all(len(c) == PART // 2 for c in chunks[:-1])
    blocks = -(-size // PART)  # a block is one part: two chunks
    assert len(reader.gets) == blocks
    assert len(rings._free) == min(blocks, min(blocks, 3) + 1)  # the ring went back whole


def test_a_failed_range_is_raised_and_no_read_is_left_in_flight(pool: Executor) -> None:
    data = os.urandom(12 * PART)
    reader = BytesRanges(data, pool, fail_at=frozenset({5 * PART}))
    rings = Rings(64 * PART)
    got = bytearray()
    with pytest.raises(ConnectionError, match=str(5 * PART)):
        for chunk in read_ahead(reader, PART, readahead_bytes=4 * PART, rings=rings):
            got += chunk
    assert bytes(got) == data[: 5 * PART]
    assert reader.finished == len(reader.gets)  # every range started has ended...
    assert len(rings._free) == 5  # ...before the whole ring (window + 1) went back


def test_the_rings_keep_buffers_up_to_their_limit() -> None:
    rings = Rings(3 * PART)
    first = rings.take(4, PART)
    rings.give(first)
    again = rings.take(4, PART)
    assert sum(any(b is a for a in first) for b in again) == 3  # three kept, one made anew


def test_kvikio_wins_only_where_allowed_and_the_reader_serves_a_url(pool: Executor) -> None:
    reader = BytesRanges(b"x" * PART, pool)  # serves no URL
    with pytest.raises(ValueError, match="mode"):
        KvikioReads("curl", threads=4, expires_s=60)  # type: ignore[arg-type]
    assert not KvikioReads("never", threads=4, expires_s=60).wins(reader, 1 << 30)
    assert not KvikioReads("auto", threads=4, expires_s=60).wins(reader, 1 << 30)
    assert not KvikioReads("auto", threads=4, expires_s=60).wins(None, 1 << 30)


def test_kvikio_by_name_without_it_is_refused() -> None:
    try:
        importlib.import_module("kvikio.remote_file")
        pytest.skip("KvikIO is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError):
        KvikioReads("kvikio", threads=4, expires_s=60)
    auto = KvikioReads("auto", threads=4, expires_s=60)
    assert auto.load() is None and not auto.strict
