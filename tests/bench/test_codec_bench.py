"""``tierd bench codec`` at a small size: the ratio against its target, encode and decode on
one core and on every core, and the raw read beside the compressed one, each read checked by
the bench itself. Speed is never asserted."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tierd_bench._nginx import NGINX
from tierd_bench.codec import encode_work, run, synthetic_bf16
from tiering.codec import Container, Encoder, two_byte_spans


def test_codec_bench_measures_each_figure() -> None:
    report = run(16 << 20, repeats=1, threads=2)
    rows = report.rows
    assert rows["ratio"].met is True and rows["ratio"].value is not None
    assert rows["ratio"].value <= 0.72
    for key in ("encode_1", "encode_all", "decode_1", "decode_all", "read_raw", "read_compressed"):
        assert rows[key].value is not None and rows[key].value > 0, key
    assert rows["read_compressed"].vs == "read_raw"
    assert report.setup["stored_bytes"] < 16 << 20


@pytest.mark.skipif(not NGINX.exists(), reason=f"needs nginx ({NGINX}; apt-get install nginx)")
def test_codec_bench_loads_from_a_bucket_plain_and_compressed(host_network: None) -> None:
    """The object rows: the checkpoint in an nginx origin as it is and as tierd's object tier
    stores it, each loaded whole through an object tier and checked by the bench; the origin
    sent the compressed one's stored bytes only."""
    report = run(16 << 20, repeats=1, threads=2, device="cpu", origin="s3like", connections=8)
    rows = report.rows
    assert rows["obj_raw"].value and rows["obj_compressed"].value
    assert rows["obj_compressed"].vs == "obj_raw"
    assert "stored bytes" in (rows["obj_compressed"].note or "")
    assert report.setup["origin"] == "s3like" and report.setup["connections"] == 8


def test_both_encode_rows_time_the_same_work() -> None:
    """The 1-core and N-thread encode rows run one function, on this thread or on a pool,
    and it makes the chunks the Encoder stores (the 1-core row timed the whole Encoder, the
    other a chunk step with a new compressor per chunk: their ratio compared other code)."""
    data = synthetic_bf16(17 << 20)
    work = encode_work(data)
    with ThreadPoolExecutor(2) as pool:
        many = work(pool)
    one = work(None)
    assert one == many and len(one) == 3
    stored = bytearray()
    encoder = Encoder(stored.extend)
    encoder.write(data)
    encoder.finish()
    index = Container.open("c", lambda n, off: bytes(stored[off : off + n]), len(stored)).index
    assert [(kind, sum(map(len, parts))) for kind, parts in one] == [
        (e.kind, e.length) for e in index
    ]
    assert [b"".join(parts) for _, parts in one] == [
        bytes(stored[e.offset : e.offset + e.length]) for e in index
    ]


def test_codec_bench_from_the_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    result = CliRunner().invoke(
        cli, ["bench", "codec", "--size", "8MiB", "--repeats", "1", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert set(json.loads(out.read_text())["rows"]) >= {"ratio", "decode_1", "read_raw"}


def test_codec_bench_refuses_a_size_under_one_chunk() -> None:
    with pytest.raises(ValueError):
        run(1 << 20)
    result = CliRunner().invoke(cli, ["bench", "codec", "--size", "1MiB"])
    assert result.exit_code != 0


def test_the_synthetic_checkpoint_is_bf16_safetensors() -> None:
    data = synthetic_bf16(1 << 20, tensors=3)
    n = int.from_bytes(data[:8], "little")
    assert (8 + n) % 8 == 0
    assert two_byte_spans(data) == [(8 + n, len(data))]


@pytest.mark.gpu
def test_codec_bench_on_a_gpu_loads_plain_decoded_there_and_on_the_host() -> None:
    from tests.io.conftest import cuda_ok

    if not cuda_ok():
        pytest.skip("needs CuPy and a CUDA device")
    report = run(24 << 20, repeats=1, threads=2, device="cuda:0")
    rows = report.rows
    for key in ("gpu_ceiling", "gpu_plain", "gpu_host_decode", "gpu_plain_cold"):
        assert rows[key].value is not None and rows[key].value > 0, key
    if report.setup["gpu_decode"] == "nvCOMP":
        assert rows["gpu_nvcomp"].vs == "gpu_plain"
        assert rows["gpu_nvcomp_cold"].vs == "gpu_plain_cold"
        assert rows["gpu_nvcomp"].value is not None and "nvcomp" in (rows["gpu_nvcomp"].note or "")


@pytest.mark.gpu
@pytest.mark.skipif(not NGINX.exists(), reason=f"needs nginx ({NGINX}; apt-get install nginx)")
def test_codec_bench_decodes_a_compressed_object_on_the_gpu(host_network: None) -> None:
    from tests.io.conftest import cuda_ok
    from tiering.io._decode_gpu import available

    if not cuda_ok() or available() is not None:
        pytest.skip("needs CuPy, a CUDA device and nvCOMP")
    report = run(24 << 20, repeats=1, threads=2, device="cuda:0", origin="s3like")
    rows = report.rows
    assert rows["obj_raw"].value and rows["obj_compressed"].value
    assert "engine nvcomp" in (rows["obj_compressed"].note or "")
