"""How tierd's own HTTP connections plan a read (:mod:`tiering.ranges._http`,
:mod:`tiering.io._remote_http`): one GET alone tells a fast origin from a paced one, once; a
fast one is read in GETs of twice the task size on half the connections; lanes bound the GETs
in flight and stop after a failure; the pinned pieces of reads into GPU memory are bounded
however many threads read. Real loopback HTTP servers, one of them paced."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.io.conftest import cuda_ok, kvikio_ok
from tiering.io._device import Device
from tiering.io._remote_http import Stagings, _in_lanes, read_if_fast
from tiering.ranges import HttpReads, RangeReader

KiB, MiB = 1 << 10, 1 << 20


class _Ranges(BaseHTTPRequestHandler):
    """Ranged GETs of ``server.data`` (HTTP/1.1, kept alive), each logged; at
    ``server.pace`` bytes/s when set (16 KiB at a time)."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else the body waits for the head's delayed ACK (40 ms)

    def do_GET(self) -> None:  # noqa: N802 - the base's name
        srv: Any = self.server
        first, _, last = self.headers["Range"].removeprefix("bytes=").partition("-")
        a, b = int(first), int(last) + 1
        srv.gets.append((a, b - a))
        self.send_response(206)
        self.send_header("Content-Length", str(b - a))
        self.send_header("Content-Range", f"bytes {a}-{b - 1}/{len(srv.data)}")
        self.end_headers()
        body = memoryview(srv.data)[a:b]
        step = 16 * KiB if srv.pace else len(body)
        for at in range(0, len(body), step):
            self.wfile.write(body[at : at + step])
            if srv.pace:
                time.sleep(step / srv.pace)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        pass


@pytest.fixture
def origin() -> Iterator[Any]:
    """``origin(pace)``: a loopback server of 2 MiB of random bytes, paced or not."""
    servers: list[ThreadingHTTPServer] = []
    data = np.random.default_rng(3).integers(0, 256, 2 * MiB, dtype=np.uint8).tobytes()

    def start(pace: float | None) -> Any:
        srv: Any = ThreadingHTTPServer(("127.0.0.1", 0), _Ranges)
        srv.data, srv.gets, srv.pace = data, [], pace
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _host(arr: Any) -> np.ndarray:
    if hasattr(arr, "__cuda_array_interface__"):
        import cupy as cp

        return cp.asnumpy(arr)  # type: ignore[no-any-return]
    return np.asarray(arr)


class _UrlReader(RangeReader):
    serves_url = True

    def __init__(self, url: str, size: int) -> None:
        super().__init__(url, size, "v1", pool=ThreadPoolExecutor(2), part_size=1 << 20)
        self._url = url

    def get(self, view: memoryview, offset: int) -> None:
        raise AssertionError("no GET fails here")

    def url(self, expires_s: int) -> str:
        return self._url


# A loopback server moves 256 KiB in about a millisecond (over 100 MB/s) unpaced, and at
# 2 MB/s paced. 6 MB/s: three times the paced rate, and a fast GET may stall 40 ms (four
# pytest workers on two cores stalled one past 13 ms, 20 MB/s's bound, and it read as paced).
FAST_HERE = 6e6
CPU = Device.parse("cpu")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("pace", [None, 2e6], ids=["fast", "paced"])
def test_the_first_get_alone_judges_the_origin_and_no_byte_is_read_twice(
    origin: Any, pace: float | None, device: str
) -> None:
    """The first read sends its first GET of the task size alone: a fast origin then gets the
    rest in GETs of twice the task size; a paced one gets nothing more here (KvikIO, or GETs of
    the task size, read the rest). Later reads are planned at once; every byte is sent once.
    Into cuda the GETs land in pinned pieces on their way."""
    if device != "cpu" and not cuda_ok():
        pytest.skip("needs CuPy and a CUDA device")
    dev = Device.parse(device)
    srv = origin(pace)
    reads = HttpReads("auto", threads=4, task_size=256 * KiB, expires_s=60, fast_bps=FAST_HERE)
    stagings = Stagings(2 * reads.task_size, reads.threads)
    try:
        ranges = reads.open(_UrlReader(f"http://127.0.0.1:{srv.server_port}/w", 2 * MiB))
        assert reads.known(ranges) is None
        buf = dev.empty(2 * MiB - 5)  # a ragged end
        buf[:] = 0
        segments = [(5, 1000, 0), (1005, len(buf) - 1000, 1000)]
        left = read_if_fast(ranges, buf, segments, device=dev, stagings=stagings)
        out = _host(buf)
        assert srv.gets[0] == (1005, 256 * KiB)  # the first segment that holds a whole GET
        assert reads.known(ranges) is (pace is None)
        if pace is None:
            assert left == [] and out.tobytes() == srv.data[5:]
            assert max(n for _, n in srv.gets[1:]) == 512 * KiB  # twice the task size
        else:  # the rest is the caller's, with the first GET's bytes already in place
            assert left == [(5, 1000, 0), (1005 + 256 * KiB, len(out) - 1000 - 256 * KiB,
                                           1000 + 256 * KiB)]  # fmt: skip
            assert srv.gets == [(1005, 256 * KiB)]
            got = out[1000 : 1000 + 256 * KiB].tobytes()
            assert got == srv.data[1005 : 1005 + 256 * KiB]
        sent = sum(n for _, n in srv.gets)
        assert sent == (len(out) if pace is None else 256 * KiB)  # no byte twice
        # Known now: the next read is planned at once, with no GET alone.
        srv.gets.clear()
        again = read_if_fast(ranges, buf, [(0, 1 * MiB, 0)], device=dev, stagings=stagings)
        if pace is None:
            assert again == [] and sorted(srv.gets) == [(0, 512 * KiB), (512 * KiB, 512 * KiB)]
        else:
            assert again == [(0, 1 * MiB, 0)] and srv.gets == []
    finally:
        reads.close()


def test_a_read_with_no_whole_get_is_not_judged_by(origin: Any) -> None:
    """Small segments say more of latency than of the origin's rate: no judgement yet."""
    srv = origin(None)
    reads = HttpReads("auto", threads=4, task_size=256 * KiB, expires_s=60, fast_bps=FAST_HERE)
    try:
        ranges = reads.open(_UrlReader(f"http://127.0.0.1:{srv.server_port}/w", 2 * MiB))
        out = np.zeros(2000, np.uint8)
        segments = [(0, 1000, 0), (5000, 1000, 1000)]
        stagings = Stagings(2 * reads.task_size, 4)
        assert read_if_fast(ranges, out, segments, device=CPU, stagings=stagings) == segments
        assert srv.gets == [] and reads.known(ranges) is None
        assert reads.plan(True) == (512 * KiB, 2) and reads.plan(False) == (256 * KiB, 4)
    finally:
        reads.close()


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


def test_auto_judges_a_real_store_by_the_reads_own_first_get(
    make_object_tier: Any, fault_proxy: Any, s3_client: Any, s3_bucket: str
) -> None:
    """moto behind the fault proxy, under ``auto``: its first GET, alone, is far below
    FAST_BPS, so it is a paced origin; the rest goes to KvikIO where it is installed, else to
    GETs of the task size. No byte is read twice: as many GETs as without the judgement."""
    from tiering.io import GdsConfig, GpuDirectStorage

    size = 300 * KiB + 77
    data = np.random.default_rng(4).integers(0, 256, size, dtype=np.uint8).tobytes()
    s3_client.put_object(Bucket=s3_bucket, Key="pre/w.bin", Body=data)
    tier = make_object_tier("s3", endpoint_url=fault_proxy.url)
    config = GdsConfig(remote_url_min_bytes=0, remote_url_task_size=64 * KiB, remote_url_threads=4)

    def signed_gets() -> int:
        return len([r for r in fault_proxy.log if r[0] == "GET" and "X-Amz-Signature" in r[1]])

    with (
        GpuDirectStorage("cpu", config) as gds,
        gds.open_source(tier.open("w.bin"), tier="s3", rank=1) as f,
    ):
        before = signed_gets()
        r = gds.read(f)
        assert np.asarray(r.array).tobytes() == data
        if kvikio_ok():
            assert r.report.engine == "kvikio"
        else:
            assert r.report.engine == "sockets"
            assert signed_gets() - before == 5  # 64 KiB alone, then 4 more: 300 KiB + 77
