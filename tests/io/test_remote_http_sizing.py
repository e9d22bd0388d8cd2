"""How tierd's own HTTP connections size and bound a read (:mod:`tiering.ranges._http`,
:mod:`tiering.io._remote_http`): GETs sized by the rate each origin's connections have shown,
as many fewer at once; lanes that bound the GETs in flight and stop after a failure; and the
pinned pieces of reads into GPU memory, bounded however many threads read."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.io.conftest import cuda_ok
from tiering.io._device import Device
from tiering.io._remote import _split
from tiering.io._remote_http import Stagings, _in_lanes, read_segments
from tiering.ranges import HttpReads, RangeReader
from tiering.ranges._http import GET_SECONDS

KiB, MiB = 1 << 10, 1 << 20
CPU = Device.parse("cpu")


def test_get_size_follows_each_origins_rate() -> None:
    reads = HttpReads("auto", threads=64, task_size=8 * MiB, expires_s=60)
    fast, paced = ("127.0.0.1", 80), ("s3.example.com", 80)
    assert reads.get_size(*fast) == 8 * MiB  # nothing seen yet: the task size
    assert not reads.paced(*fast)  # nor judged paced: its first read is by these connections
    assert reads.lanes(8 * MiB) == 64
    reads.observed(*fast, 8 * MiB, 0.006)  # 1.4 GB/s a connection (nginx on loopback)
    reads.observed(*paced, 8 * MiB, 0.084)  # 100 MB/s (S3-like)
    assert reads.get_size(*fast) == reads.max_get == 16 * MiB
    assert reads.lanes(16 * MiB) == 32  # the same bytes in flight
    assert reads.get_size(*paced) == 8 * MiB  # every connection kept busy
    # auto hands a paced origin's reads to KvikIO, where it is installed; a fast one keeps them
    assert reads.paced(*paced) and not reads.paced(*fast)
    # One slow GET moves the origin's rate a fifth of the way, not all of it.
    reads.observed(*fast, 8 * MiB, 1.0)
    assert reads.get_size(*fast) == 16 * MiB
    for _ in range(30):
        reads.observed(*fast, 8 * MiB, 1.0)
    assert reads.get_size(*fast) == 8 * MiB
    # In between: GETs of GET_SECONDS at the rate, in whole pages.
    mid = HttpReads("auto", threads=4, task_size=1 * MiB, expires_s=60)
    mid.observed(*fast, 1 * MiB, 1 * MiB / (75 * MiB))  # 75 MiB/s: 1.5 MiB in GET_SECONDS
    size = mid.get_size(*fast)
    assert 1 * MiB < size < 2 * MiB and size % 4096 == 0
    assert abs(size - 75 * MiB * GET_SECONDS) < 4096


class _Ranges(BaseHTTPRequestHandler):
    """Ranged GETs of ``server.data`` (HTTP/1.1, kept alive), each counted."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else the body waits for the head's delayed ACK (40 ms)

    def do_GET(self) -> None:  # noqa: N802 - the base's name
        data: bytes = self.server.data  # type: ignore[attr-defined]
        first, _, last = self.headers["Range"].removeprefix("bytes=").partition("-")
        a, b = int(first), int(last) + 1
        self.server.gets.append(b - a)  # type: ignore[attr-defined]
        self.send_response(206)
        self.send_header("Content-Length", str(b - a))
        self.send_header("Content-Range", f"bytes {a}-{b - 1}/{len(data)}")
        self.end_headers()
        self.wfile.write(data[a:b])

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        pass


class _UrlReader(RangeReader):
    serves_url = True

    def __init__(self, url: str, size: int) -> None:
        super().__init__(url, size, "v1", pool=ThreadPoolExecutor(2), part_size=1 << 20)
        self._url = url

    def get(self, view: memoryview, offset: int) -> None:
        raise AssertionError("no GET fails here")

    def url(self, expires_s: int) -> str:
        return self._url


def test_a_fast_origin_is_read_in_fewer_larger_gets() -> None:
    """The first read of an origin goes out in GETs of the task size; once its connections
    have shown a rate above 2 x 4 KiB in GET_SECONDS (410 KB/s: any loopback server), in GETs
    of 8 KiB, half as many; read as a storage's remote reads cut them."""
    data = np.random.default_rng(1).integers(0, 256, 256 * KiB, dtype=np.uint8).tobytes()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ranges)
    server.data, server.gets = data, []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    reads = HttpReads("auto", threads=4, task_size=4 * KiB, expires_s=60)
    try:
        ranges = reads.open(_UrlReader(f"http://127.0.0.1:{server.server_port}/w", len(data)))
        for gets in (64, 32):
            size = ranges.get_size()
            assert size == 256 * KiB // gets
            out = np.zeros(len(data), np.uint8)
            segments = _split([(0, len(data), 0)], size)
            read_segments(ranges, out, segments, lanes=reads.lanes(size), device=CPU,
                          stagings=Stagings(reads.max_get, 4))  # fmt: skip
            assert out.tobytes() == data
            assert server.gets == [size] * gets  # type: ignore[attr-defined]
            server.gets.clear()  # type: ignore[attr-defined]
    finally:
        reads.close()
        server.shutdown()
        server.server_close()


def test_lanes_bound_the_gets_in_flight_and_stop_after_a_failure() -> None:
    pool = ThreadPoolExecutor(16)
    ranges = SimpleNamespace(pool=pool)
    lock = threading.Lock()
    now, most, done = [0], [0], []

    def one(off: int, n: int, at: int) -> None:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.002)
        with lock:
            now[0] -= 1
            done.append(off)

    try:
        _in_lanes(ranges, 3, [(i, 1, i) for i in range(40)], one)  # type: ignore[arg-type]
        assert sorted(done) == list(range(40)) and most[0] <= 3

        done.clear()

        def fails_at_5(off: int, n: int, at: int) -> None:
            if off == 5:
                raise OSError("the fifth GET")
            one(off, n, at)

        with pytest.raises(OSError, match="fifth"):
            _in_lanes(ranges, 2, [(i, 1, i) for i in range(200)], fails_at_5)  # type: ignore[arg-type]
        assert len(done) < 20  # no lane took another GET once the failure was seen
    finally:
        pool.shutdown()


@pytest.mark.gpu
def test_pinned_pieces_are_bounded_and_a_take_waits_for_a_piece_given_back() -> None:
    if not cuda_ok():
        pytest.skip("needs CuPy and a CUDA device")
    import cupy as cp

    stagings = Stagings(1 * MiB, 2)
    a, b = stagings.take(cp), stagings.take(cp)
    assert a is not b
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(stagings.take(cp)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # both pieces are out: no third is made
    dev = cp.zeros(1 * MiB, cp.uint8)
    a.views[0][:] = 7
    a.copy_out(cp, 0, int(dev.data.ptr), 0, 1 * MiB)
    a.mark(cp, 0)
    stagings.give(a)
    waiter.join(5)
    assert got == [a]  # the piece given back, once its copy had landed
    assert int(dev.sum()) == 7 * MiB
    stagings.give(b)
    assert stagings.take(cp) is b
