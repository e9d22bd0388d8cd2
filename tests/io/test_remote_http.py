"""Remote reads over tierd's own HTTP connections (:mod:`tiering.ranges._http`,
:mod:`tiering.io._remote_http`), against a real S3 server (moto) by presigned URL, and through
the fault proxy in front of it: the engine chosen, exact bytes, ``If-Match`` on every GET, a
GET retried on a new connection, a range read through the tier's own GETs after two failures,
responses that lie refused, URLs the engine does not read. On the GPU machine the same reads
go into cuda:0 through pinned pieces."""

from __future__ import annotations

import importlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tests.io.conftest import cuda_ok, kvikio_ok
from tests.s3_faults import FaultProxy, Headers
from tiering.errors import FileChanged
from tiering.io import GdsConfig, GpuDirectStorage
from tiering.ranges import HttpReads, HttpUnsupported, RangeReader

KiB = 1 << 10
SIZE = 300 * KiB + 77  # five GETs of 64 KiB, a ragged end
SOCKETS = GdsConfig(
    remote_backend="sockets",
    remote_url_min_bytes=0,
    remote_url_task_size=64 * KiB,
    remote_url_threads=4,
)
SIGNED = "X-Amz-Signature"  # in the query of the engine's GETs only (presigned)

DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]


def _data(seed: int, size: int = SIZE) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _host(arr: Any) -> bytes:
    if hasattr(arr, "__cuda_array_interface__"):
        return bytes(importlib.import_module("cupy").asnumpy(arr).tobytes())
    return np.asarray(arr).tobytes()


@pytest.fixture
def put(s3_client: Any, s3_bucket: str) -> Callable[[str, bytes], None]:
    def put_(relpath: str, data: bytes) -> None:
        s3_client.put_object(Bucket=s3_bucket, Key=f"pre/{relpath}", Body=data)

    return put_


@pytest.fixture(params=DEVICES)
def gds(request: pytest.FixtureRequest) -> Iterator[GpuDirectStorage]:
    if request.param.startswith("cuda") and not cuda_ok():
        pytest.skip("needs CuPy and a CUDA device")
    with GpuDirectStorage(request.param, SOCKETS) as storage:
        yield storage


def _signed_gets(proxy: FaultProxy) -> list[tuple[str, str, str]]:
    return [r for r in proxy.log if r[0] == "GET" and SIGNED in r[1]]


def test_reads_go_straight_into_the_destination_with_exact_bytes(
    gds: GpuDirectStorage, object_tier: Any, put: Callable[[str, bytes], None]
) -> None:
    data = _data(1)
    put("w.bin", data)
    with gds.open_source(object_tier.open("w.bin"), tier="s3", rank=1) as f:
        r = gds.read(f)
        assert (r.report.io_path, r.report.engine) == ("remote", "sockets")
        assert _host(r.array) == data
        for off, n in [(0, 1), (64 * KiB - 1, 2), (3, 200 * KiB + 5), (SIZE - 7, 7)]:
            got = gds.read(f, off, n)
            assert got.report.engine == "sockets"
            assert _host(got.array) == data[off : off + n], (off, n)
    assert gds.stats().by_path["remote"].operations_completed == 5


@pytest.mark.parametrize(
    ("mode", "engine"),
    [
        ("auto", "kvikio" if kvikio_ok() else "sockets"),  # KvikIO first, where installed
        ("sockets", "sockets"),
        ("python", "python"),
    ],
)
def test_remote_backend_picks_the_engine(
    object_tier: Any, put: Callable[[str, bytes], None], mode: str, engine: str
) -> None:
    data = _data(2)
    put("w.bin", data)
    config = GdsConfig(remote_backend=mode, remote_url_min_bytes=0)  # type: ignore[arg-type]
    with GpuDirectStorage("cpu", config) as gds:
        with gds.open_source(object_tier.open("w.bin"), tier="s3", rank=1) as f:
            r = gds.read(f)
        assert (r.report.engine, _host(r.array)) == (engine, data)


def test_small_reads_take_the_tiers_own_gets(
    object_tier: Any, put: Callable[[str, bytes], None]
) -> None:
    put("w.bin", _data(3))
    config = GdsConfig(remote_backend="sockets", remote_url_min_bytes=1 << 20)
    with (
        GpuDirectStorage("cpu", config) as gds,
        gds.open_source(object_tier.open("w.bin"), tier="s3", rank=1) as f,
    ):
        assert gds.read(f).report.engine == "python"


def test_every_get_is_pinned_so_an_overwrite_is_file_changed_without_a_head(
    gds: GpuDirectStorage,
    make_object_tier: Callable[..., Any],
    fault_proxy: FaultProxy,
    put: Callable[[str, bytes], None],
) -> None:
    tier = make_object_tier(endpoint_url=fault_proxy.url)
    put("w.bin", _data(4))
    with gds.open_source(tier.open("w.bin"), tier="s3", rank=1) as f:
        assert _host(gds.read(f, 0, 4096).array) == _data(4)[:4096]  # the URL is presigned
        heads = [r for r in fault_proxy.log if r[0] == "HEAD"]
        assert _host(gds.read(f).array) == _data(4)
        assert [r for r in fault_proxy.log if r[0] == "HEAD"] == heads  # no check after
        put("w.bin", _data(5))  # behind tierd's back, same size
        with pytest.raises(FileChanged):
            gds.read(f)  # every GET carried If-Match: 412, never the new bytes
    assert any(a == "forward" for _m, _p, a in _signed_gets(fault_proxy))


@pytest.mark.parametrize("action", ["reset", "truncate", "503", "drop_response"])
def test_a_get_that_fails_once_is_sent_again_on_a_new_connection(
    gds: GpuDirectStorage,
    make_object_tier: Callable[..., Any],
    fault_proxy: FaultProxy,
    put: Callable[[str, bytes], None],
    action: str,
) -> None:
    tier = make_object_tier(endpoint_url=fault_proxy.url)
    data = _data(6)
    put("w.bin", data)
    rule = fault_proxy.fail(action, method="GET", query=SIGNED, nth=2)
    with gds.open_source(tier.open("w.bin"), tier="s3", rank=1) as f:
        r = gds.read(f)
        assert (r.report.engine, _host(r.array)) == ("sockets", data)
    assert rule.fired == 1
    gets = _signed_gets(fault_proxy)
    assert len(gets) == 5 + 1  # five GETs of 64 KiB, one of them sent twice


def test_a_get_that_fails_twice_is_read_through_the_tiers_gets(
    gds: GpuDirectStorage,
    make_object_tier: Callable[..., Any],
    fault_proxy: FaultProxy,
    put: Callable[[str, bytes], None],
) -> None:
    tier = make_object_tier(endpoint_url=fault_proxy.url)
    data = _data(7)
    put("w.bin", data)
    rule = fault_proxy.fail("500", method="GET", query=SIGNED, times=10)  # all five, twice
    with gds.open_source(tier.open("w.bin"), tier="s3", rank=1) as f:
        r = gds.read(f)
        assert (r.report.engine, _host(r.array)) == ("sockets", data)
    assert rule.fired == 10
    unsigned = [x for x in fault_proxy.log if x[0] == "GET" and SIGNED not in x[1]]
    assert unsigned, "the range was not read again through the tier's own GETs"


def _shifted(status: int, headers: Headers, body: bytes) -> tuple[int, Headers, bytes]:
    """A store that answers a range with the bytes of another offset (same length)."""
    out = [(k, v) for k, v in headers if k.lower() != "content-range"]
    first, _, rest = dict((k.lower(), v) for k, v in headers)["content-range"].partition("-")
    start = int(first.removeprefix("bytes ")) + 1
    last, _, total = rest.partition("/")
    return status, [*out, ("Content-Range", f"bytes {start}-{int(last) + 1}/{total}")], body


def _full(status: int, headers: Headers, body: bytes) -> tuple[int, Headers, bytes]:
    """A store that ignores Range: 200 and more bytes than asked for."""
    return 200, [(k, v) for k, v in headers if k.lower() != "content-range"], body + body


@pytest.mark.parametrize("edit", [_shifted, _full], ids=["wrong-range", "200-ignores-range"])
def test_a_response_that_is_not_the_range_asked_for_is_refused(
    gds: GpuDirectStorage,
    make_object_tier: Callable[..., Any],
    fault_proxy: FaultProxy,
    put: Callable[[str, bytes], None],
    edit: Any,
) -> None:
    tier = make_object_tier(endpoint_url=fault_proxy.url)
    data = _data(8)
    put("w.bin", data)
    fault_proxy.fail("edit", method="GET", query=SIGNED, times=3, edit=edit)
    with gds.open_source(tier.open("w.bin"), tier="s3", rank=1) as f:
        assert _host(gds.read(f).array) == data


def test_the_engines_gets_are_accepted_by_a_store_that_checks_signatures(
    make_object_tier: Callable[..., Any],
    moto_iam: Any,
    monkeypatch: pytest.MonkeyPatch,
    s3_client: Any,
    s3_bucket: str,
) -> None:
    """The presigned URL signs the host only: Range and If-Match ride along unsigned."""
    data = _data(9)
    s3_client.put_object(Bucket=s3_bucket, Key="pre/w.bin", Body=data)
    key, secret = moto_iam.user("s3:*")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    tier = make_object_tier()
    moto_iam.enforce()
    with (
        GpuDirectStorage("cpu", SOCKETS) as gds,
        gds.open_source(tier.open("w.bin"), tier="s3", rank=1) as f,
    ):
        r = gds.read(f)
    assert (r.report.engine, _host(r.array)) == ("sockets", data)


# -- URLs the engine does not read, and servers that misbehave -------------------------------


class _UrlReader(RangeReader):
    """A reader whose URL is given, and whose own GETs fill zeros (to see which path ran)."""

    serves_url = True

    def __init__(self, url: str, size: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        super().__init__(url, size, "v1", pool=ThreadPoolExecutor(2), part_size=1 << 20)
        self._url = url
        self.fallbacks = 0

    def get(self, view: memoryview, offset: int) -> None:
        self.fallbacks += 1
        view[:] = bytes(len(view))

    def url(self, expires_s: int) -> str:
        return self._url


@pytest.mark.parametrize(
    ("url", "env"),
    [
        ("https://example.invalid/b/k", {}),
        ("ftp://example.invalid/b/k", {}),
        ("http://example.invalid/b/k", {"http_proxy": "http://127.0.0.1:9"}),
    ],
    ids=["https", "ftp", "proxy"],
)
def test_urls_the_engine_does_not_read_are_refused_at_the_open(
    url: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    reads = HttpReads("auto", threads=2, task_size=1 << 20, expires_s=60)
    try:
        with pytest.raises(HttpUnsupported):
            reads.open(_UrlReader(url, 10))
    finally:
        reads.close()


@pytest.mark.parametrize(
    ("url", "want"),
    [
        (
            "http://s3.example.com/b/k?X-Amz-Signature=1",
            ("s3.example.com", 80, "s3.example.com", "/b/k?X-Amz-Signature=1"),
        ),
        ("http://127.0.0.1:9000/b/k", ("127.0.0.1", 9000, "127.0.0.1:9000", "/b/k")),
        ("http://[::1]:9000", ("::1", 9000, "[::1]:9000", "/")),
    ],
)
def test_the_host_header_is_the_urls_own(url: str, want: tuple[str, int, str, str]) -> None:
    """A presigned URL's signature covers its Host: ``host:80`` for ``host`` would be a 403."""
    from tiering.ranges._http import _target

    assert tuple(_target(url)) == want


@pytest.fixture
def liar() -> Iterator[Callable[[bytes], str]]:
    """``serve(reply)``: a loopback server that answers every request with ``reply`` and
    closes; its URL."""
    socks: list[socket.socket] = []
    threads: list[threading.Thread] = []

    def serve(reply: bytes) -> str:
        srv = socket.create_server(("127.0.0.1", 0))
        socks.append(srv)

        def run() -> None:
            while True:
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(65536)
                    conn.sendall(reply)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
        return f"http://127.0.0.1:{srv.getsockname()[1]}/b/k"

    yield serve
    for s in socks:
        s.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not)
        s.close()
    for t in threads:
        t.join(5)


@pytest.mark.parametrize(
    "reply",
    [
        b"garbage\r\n\r\n",
        b"HTTP/1.1 206 Partial Content\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 206 Partial Content\r\nContent-Length: 100\r\n"
        b"Content-Range: bytes 0-99/100\r\n\r\nshort",
        b"HTTP/1.1 206 Partial Content\r\nContent-Length: 100\r\n" + b"X: " + b"y" * 70000,
        b"",
    ],
    ids=["not-http", "chunked", "cut-short", "endless-head", "closed"],
)
def test_a_server_that_misbehaves_sends_the_range_to_the_readers_own_gets(
    liar: Callable[[bytes], str], reply: bytes
) -> None:
    reader = _UrlReader(liar(reply), 100)
    reads = HttpReads("auto", threads=2, task_size=1 << 20, expires_s=60, timeout_s=5)
    try:
        ranges = reads.open(reader)
        buf = bytearray(b"\xff" * 100)
        ranges.get(memoryview(buf), 0)
        assert bytes(buf) == bytes(100)  # the reader's own GET filled it
        assert reader.fallbacks == 1
    finally:
        reads.close()
        reader.pool.shutdown()
