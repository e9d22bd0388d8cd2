"""Remote reads through KvikIO's ``RemoteFile`` (:mod:`tiering.ranges._kvikio`,
:mod:`tiering.io._remote_kvikio`): the presigned URL an object source's reader hands out, the
ETag check after a read that could not send ``If-Match``, the choice of engine, and (GPU
machine, KvikIO installed) loads of an object from a real S3 server (moto) into cuda:0 and host
memory through KvikIO."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.io.conftest import cuda_ok, kvikio_ok
from tests.s3 import REGION
from tiering.config import EngineConfig, TierConfig
from tiering.engine import Engine
from tiering.errors import BackendUnavailable, Conflict, FileChanged, InvalidInput
from tiering.io import GdsConfig, GpuDirectStorage
from tiering.serving import Loader
from tiering.serving.config import LoaderConfig

KiB = 1 << 10
SIZE = 300 * KiB + 77  # several KvikIO tasks of 64 KiB, a ragged end


def _data(seed: int = 0, size: int = SIZE) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.fixture
def put(s3_client: Any, s3_bucket: str) -> Callable[[str, bytes], None]:
    """``put(relpath, data)``: an object under the tier's prefix, from another client."""

    def put_(relpath: str, data: bytes) -> None:
        s3_client.put_object(Bucket=s3_bucket, Key=f"pre/{relpath}", Body=data)

    return put_


# -- CI: presigning and the check after a read ---------------------------------------------


def test_a_presigned_url_serves_any_range_of_the_object(
    object_tier: Any, put: Callable[[str, bytes], None]
) -> None:
    data = _data()
    put("w.bin", data)
    with object_tier.open("w.bin") as src:
        url = src.ranges.url(60)
        assert "X-Amz-Signature=" in url and "X-Amz-Expires=60" in url
        for first, last in [(0, 0), (10, 99), (SIZE - 5, SIZE - 1), (4096, 200 * KiB)]:
            r = httpx.get(url, headers={"Range": f"bytes={first}-{last}"})
            assert r.status_code == 206, r.text
            assert r.content == data[first : last + 1], (first, last)
        assert httpx.get(url).content == data


@pytest.mark.parametrize("engine", ["auto", "boto3"], ids=["obstore-head", "botocore-head"])
def test_the_check_after_a_read_sees_an_overwrite_by_another_client(
    make_object_tier: Callable[..., Any], put: Callable[[str, bytes], None], engine: str
) -> None:
    object_tier = make_object_tier(read_engine=engine)
    assert object_tier.store.get_engine == ("botocore" if engine == "boto3" else "obstore")
    put("w.bin", _data(2))
    with object_tier.open("w.bin") as src:
        url = src.ranges.url(60)
        first = httpx.get(url, headers={"Range": "bytes=0-1023"}).content
        src.ranges.check_unchanged()  # nothing changed yet
        put("w.bin", _data(3))  # overwritten while "the read" is under way
        second = httpx.get(url, headers={"Range": "bytes=1024-2047"}).content
        assert first + second != _data(2)[:2048]  # a read by URL alone would mix versions...
        with pytest.raises(FileChanged) as err:
            src.ranges.check_unchanged()  # ...which the HEAD after the read refuses
        assert isinstance(err.value, Conflict)  # HTTP 409 over REST (app/errors.py)
        # The version's URL is signed once and kept (no HEAD each load): handed out again,
        # its reader's check after the read is what refuses the replaced bytes.
        assert src.ranges.url(60) == url
    with object_tier.open("w.bin") as src:  # opened again: the new object reads fine
        src.ranges.check_unchanged()
        fresh = src.ranges.url(60)  # another version: signed anew
        assert httpx.get(fresh).content == _data(3)
    put("w.bin", b"short")
    with pytest.raises(FileChanged):
        src.ranges.check_unchanged()
    with object_tier.open("w.bin") as src:
        object_tier.store.delete(src.ranges.key)  # removed by another client
        with pytest.raises(FileChanged):
            src.ranges.check_unchanged()


def test_remote_backend_is_checked() -> None:
    with pytest.raises(InvalidInput):
        GdsConfig(remote_backend="curl")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        GdsConfig(remote_url_threads=0)


@pytest.mark.skipif(kvikio_ok(), reason="KvikIO is installed here")
def test_remote_backend_kvikio_without_kvikio_is_refused() -> None:
    with pytest.raises(BackendUnavailable):
        GpuDirectStorage("cpu", GdsConfig(remote_backend="kvikio"))


@pytest.mark.parametrize("mode", ["auto", "python"])
def test_the_report_names_the_engine(
    object_tier: Any, put: Callable[[str, bytes], None], mode: str
) -> None:
    data = _data(4)
    put("w.bin", data)
    config = GdsConfig(remote_backend=mode, remote_url_min_bytes=0)  # type: ignore[arg-type]
    with GpuDirectStorage("cpu", config) as gds:
        f = gds.open_source(object_tier.open("w.bin"), tier="s3", rank=1)
        with f:
            r = gds.read(f)
        assert np.asarray(r.array).tobytes() == data
        # auto without KvikIO: tierd's own connections (tests/io/test_remote_http.py)
        expected = ("kvikio" if kvikio_ok() else "sockets") if mode == "auto" else "python"
        assert (r.report.io_path, r.report.engine) == ("remote", expected)


# -- GPU machine: KvikIO reads of a real object ----------------------------------------------

needs_kvikio = pytest.mark.skipif(not kvikio_ok(), reason="needs KvikIO")
DEVICES = [
    pytest.param("cpu", marks=[pytest.mark.gpu, needs_kvikio]),
    pytest.param("cuda:0", marks=[pytest.mark.gpu, needs_kvikio]),
]
KVIKIO = GdsConfig(remote_backend="kvikio", remote_url_task_size=64 * KiB)


def _host(arr: Any) -> np.ndarray:
    if hasattr(arr, "__cuda_array_interface__"):
        return importlib.import_module("cupy").asnumpy(arr)  # type: ignore[no-any-return]
    return np.asarray(arr)


@pytest.fixture
def kgds(request: pytest.FixtureRequest) -> Iterator[GpuDirectStorage]:
    device = request.param
    if device.startswith("cuda") and not cuda_ok():
        pytest.skip("needs CuPy and a CUDA device")
    with GpuDirectStorage(device, KVIKIO) as gds:
        yield gds


@pytest.mark.parametrize("kgds", DEVICES, indirect=True)
def test_kvikio_reads_an_object_into_the_device(
    kgds: GpuDirectStorage, object_tier: Any, put: Callable[[str, bytes], None]
) -> None:
    data = _data(5)
    put("w.bin", data)
    ref = np.frombuffer(data, np.uint8)
    with kgds.open_source(object_tier.open("w.bin"), tier="s3", rank=1) as f:
        r = kgds.read(f)
        assert (r.report.io_path, r.report.engine) == ("remote", "kvikio")
        assert np.array_equal(_host(r.array), ref)
        for off, n in [(0, 1), (65535, 2), (3, 200 * KiB + 5), (SIZE - 7, 7)]:
            got = kgds.read(f, off, n)
            assert got.report.engine == "kvikio"
            assert np.array_equal(_host(got.array), ref[off : off + n]), (off, n)
        out = kgds.device.empty(100 * KiB)
        assert int(kgds.load_to_gpu(f, 100, out)) == 100 * KiB
        assert np.array_equal(_host(out), ref[100 : 100 + 100 * KiB])
    assert kgds.stats().by_path["remote"].operations_completed == 6


@pytest.mark.parametrize("kgds", DEVICES, indirect=True)
def test_kvikio_read_of_an_overwritten_object_is_file_changed(
    kgds: GpuDirectStorage, object_tier: Any, put: Callable[[str, bytes], None]
) -> None:
    put("w.bin", _data(6))
    with kgds.open_source(object_tier.open("w.bin"), tier="s3", rank=1) as f:
        assert kgds.read(f, 0, 4096).report.engine == "kvikio"  # the URL is presigned now
        put("w.bin", _data(7))  # behind tierd's back; KvikIO reads the new bytes...
        with pytest.raises(FileChanged):
            kgds.read(f)  # ...and the HEAD after the read refuses them


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("backend", "engine"),
    [
        pytest.param("auto", "kvikio", marks=needs_kvikio),  # KvikIO from 1 MiB up
        ("sockets", "sockets"),  # tierd's own connections (tests/io/test_remote_http.py)
    ],
)
def test_a_loader_loads_an_object_into_cuda_by_url(
    tmp_path: Path,
    moto_endpoint: str,
    s3_bucket: str,
    s3_env: Any,
    s3_client: Any,
    backend: str,
    engine: str,
) -> None:
    if not cuda_ok():
        pytest.skip("needs CuPy and a CUDA device")
    data = _data(8, 2 << 20)
    s3_client.put_object(Bucket=s3_bucket, Key="models/m.bin", Body=data)
    s3 = TierConfig(
        "s3", kind="object", url=f"s3://{s3_bucket}/models", endpoint_url=moto_endpoint,
        region=REGION,
    )  # fmt: skip
    cfg = EngineConfig(
        tiers=(TierConfig("nvme", tmp_path / "nvme"), s3),
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}",
        watch=False,
    )
    io = GdsConfig(remote_backend=backend, remote_url_min_bytes=1 << 20)  # type: ignore[arg-type]
    with Engine(cfg) as eng:
        eng.scan()
        fid = eng.lookup("m.bin").id
        loader = Loader(eng, LoaderConfig(io=io, cpu_budget_bytes=64 << 20)).start()
        try:
            lease = loader.load(fid, device="cuda:0")
            assert lease.report is not None
            assert (lease.report.io_path, lease.report.engine) == ("remote", engine)
            arr = lease.buffer.array()[lease.offset : lease.offset + lease.nbytes]
            assert _host(arr).tobytes() == data
            loader.leases.release(lease.id)
        finally:
            loader.stop()


def test_a_version_is_signed_once_for_many_loads(
    make_object_tier: Any, fault_proxy: Any, s3_client: Any, s3_bucket: str
) -> None:
    """Loads of one object version: the first signs a URL after a HEAD; the next are handed
    that URL with no request; the check after each read still sends its HEAD."""
    s3_client.put_object(Bucket=s3_bucket, Key="pre/w.bin", Body=_data(4))
    tier = make_object_tier("s3", endpoint_url=fault_proxy.url)
    with tier.open("w.bin") as src:
        first = src.ranges.url(60)
    heads = len([r for r in fault_proxy.log if r[0] == "HEAD"])
    with tier.open("w.bin", etag=src.stat.etag, known=src.stat) as again:
        assert again.ranges.url(60) == first
        assert len([r for r in fault_proxy.log if r[0] == "HEAD"]) == heads  # none sent
        again.ranges.check_unchanged()
    assert len([r for r in fault_proxy.log if r[0] == "HEAD"]) == heads + 1
