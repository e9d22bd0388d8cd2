"""``tierd bench object-store`` end to end, tiny sizes, against moto and (when Debian's nginx is
installed) the S3-like nginx origin; and the origin and byte checks it stands on.

Figures are never checked against a speed: only that every row is there, that tierd's rows
carry a ratio to their reference, that the bytes of every result were checked (a wrong
checksum stops the bench), and that nothing is left behind.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tests.helpers import cli_text
from tierd_bench import _nginx, _origin, _runai
from tierd_bench._objrun import (
    BytesMismatch,
    check_bytes,
    checksum_of_file,
    cpu_of,
    write_source,
)
from tierd_bench._s3peers import SWEEP
from tierd_bench.objectstore import OriginUnavailable, run

from .test_cli_bench import run_to_json

pytest.importorskip("moto.server", reason="moto[server] is not installed")

needs_nginx = pytest.mark.skipif(
    not _nginx.NGINX.exists(), reason=f"Debian's nginx is not installed at {_nginx.NGINX}"
)

ARGS = ["--size", "2MiB", "--device", "cpu", "--repeats", "1", "--objects", "100"]
ARGS += ["--samples", "20"]
ROWS = {
    "ceil_one_conn",
    "ceil_local_write",
    "promote_tierd",
    "promote_boto3",
    "promote_obstore_get",
    "promote_obstore_ranges",
    "promote_s3fs",
    "promote_best",
    "demote_tierd",
    "demote_boto3",
    "load_tierd_cpu",
    "load_boto3_ranges_cpu",
    "load_obstore_ranges_cpu",
    "load_s3fs_cpu",
    "load_kvikio_cpu",
    "load_runai_cpu",
    "load_tierd_alt_cpu",  # in turns with KvikIO: "kvikio not installed" on the CI machine
    "load_kvikio_alt_cpu",
    "load_best_cpu",
    "load_pybest_cpu",
    "rest_tierd_cpu",
    "rest_tierd_cpu_vs_py",
    "promote_bound",
    "promote_tierd_vs_bound",
    "small_tierd_p50_us",
    "small_tierd_p99_us",
    "small_rest_p50_us",
    "small_rest_p99_us",
    "small_boto3_p50_us",
    "small_boto3_p99_us",
    "serve_idle_p99_us",
    "serve_busy_p99_us",
    "adopt_tierd",
}
# Rows with a rate and the CPU it cost (the ceilings of a copy, and the "best" rows that name
# another row, carry none).
COSTED = {"promote_tierd", "promote_boto3", "promote_obstore_get", "promote_obstore_ranges"}
COSTED |= {"load_tierd_cpu", "load_boto3_ranges_cpu", "load_obstore_ranges_cpu", "ceil_one_conn"}


def _sweeps(kinds: tuple[str, ...], connections: int | None) -> set[str]:
    sweep = SWEEP if connections is None else [(connections, m) for m in (8, 16, 64)]
    return {f"{kind}_boto3_{c}x{m}" for kind in kinds for c, m in sweep}


def _assert_report(
    doc: dict[str, Any], origin: str, writable: bool, connections: int | None = None
) -> None:
    rows = doc["rows"]
    kinds = ("promote", "demote") if writable else ("promote",)
    # Run:ai's sweep rows are there only where it is installed.
    runai = {k for k in rows if k.startswith("load_runai_cpu_")}
    assert set(rows) == ROWS | _sweeps(kinds, connections) | runai
    assert doc["setup"]["origin"] == origin and doc["setup"]["checksum"].startswith("xxh3_128:")
    assert doc["setup"]["devices"] == ["cpu"]  # --device cpu: no cuda row anywhere
    assert doc["setup"]["peer_connections"] == (connections or 64)
    assert doc["setup"]["tier_connections"] == connections
    measured = ["promote_tierd", "load_tierd_cpu", "promote_boto3", "load_boto3_ranges_cpu"]
    measured += ["rest_tierd_cpu", "rest_tierd_cpu_vs_py", "promote_bound"]
    measured += ["demote_tierd", "demote_boto3"] if writable else []
    for key in measured:
        assert isinstance(rows[key]["value"], float) and rows[key]["value"] > 0, key
    # KvikIO is the loads' reference where it is installed; the best peer stands in elsewhere.
    load_ref = "load_kvikio_cpu" if rows["load_kvikio_cpu"]["value"] else "load_best_cpu"
    targets = [
        ("promote_tierd", "promote_best", ">= 1x"),
        ("load_tierd_cpu", load_ref, ">= 1x"),
        ("rest_tierd_cpu", "load_tierd_cpu", ">= 0.9x"),
        ("rest_tierd_cpu_vs_py", "load_pybest_cpu", ">= 0.9x"),
        ("promote_tierd_vs_bound", "promote_bound", ">= 0.9x"),
        ("serve_busy_p99_us", "serve_idle_p99_us", "<= 2x"),
    ]
    targets += [("demote_tierd", "demote_boto3", ">= 0.9x")] if writable else []
    for key, vs, target in targets:
        assert rows[key]["vs"] == vs and isinstance(rows[key]["ratio"], float), key
        assert isinstance(rows[key]["met"], bool) and rows[key]["target"] == target, key
    assert rows["rest_tierd_cpu_vs_py"]["value"] == rows["rest_tierd_cpu"]["value"]
    for key in COSTED:
        assert "CPU-s/GB)" in rows[key]["note"], key
    assert "CPU-s/GB, client + server)" in rows["rest_tierd_cpu"]["note"]
    for who in ("tierd", "rest", "boto3"):
        p50, p99 = rows[f"small_{who}_p50_us"], rows[f"small_{who}_p99_us"]
        assert p50["unit"] == "us" and 0 < p50["value"] <= p99["value"], who
        assert "(20 reads)" in p50["note"] and "CPU-us a read" in p50["note"], who
        if who != "boto3":  # a ratio to boto3's, and no target: the issue sets none
            assert p50["vs"] == "small_boto3_p50_us" and p99["vs"] == "small_boto3_p99_us"
            assert p50["target"] is None and isinstance(p50["ratio"], float)
    assert "client + server" in rows["small_rest_p50_us"]["note"]
    assert rows["serve_idle_p99_us"]["value"] > 0 and rows["serve_busy_p99_us"]["value"] > 0
    assert (
        "(p50 " in rows["serve_busy_p99_us"]["note"]
        and "loads)" in rows["serve_busy_p99_us"]["note"]
    )
    if not writable:
        assert rows["demote_tierd"]["value"] is None
        assert "read-only" in rows["demote_tierd"]["note"]
    adopt = rows["adopt_tierd"]
    assert adopt["unit"] == "objects/s" and adopt["value"] > 0 and isinstance(adopt["met"], bool)
    for key in ("promote_s3fs", "load_kvikio_cpu", "load_runai_cpu"):  # an absent peer says so
        assert rows[key]["value"] is not None or rows[key]["note"], key
    # Grouped: ceilings, promotion, demotion, loads (tierd first), REST, small reads, serving.
    keys = list(rows)
    assert keys.index("load_tierd_cpu") < keys.index("load_boto3_ranges_cpu")
    assert keys.index("load_best_cpu") < keys.index("rest_tierd_cpu")
    assert keys.index("rest_tierd_cpu") < keys.index("small_tierd_p50_us")
    assert keys.index("small_rest_p99_us") < keys.index("small_boto3_p50_us")
    assert keys.index("small_boto3_p99_us") < keys.index("serve_idle_p99_us")


def _work(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    return work


@pytest.mark.slow  # suite time (~7 CPU-seconds): the nginx origin's run below covers the bench
def test_bench_object_store_against_moto(tmp_path: Path) -> None:
    work = _work(tmp_path)
    args = ["object-store", *ARGS, "--origin", "moto", "--dir", str(work)]
    doc = run_to_json(tmp_path, "object-store", *args)
    _assert_report(doc, "moto", writable=True)
    # The nvme tier, source, catalogs and the REST server's data dir removed; and the server
    # stopped (its CPU was read from /proc while it ran).
    assert list(work.iterdir()) == []


@needs_nginx
def test_bench_object_store_flag_against_nginx_s3like(tmp_path: Path, host_network: None) -> None:
    work = _work(tmp_path)
    args = ["--object-store", *ARGS, "--origin", "s3like", "--rate", "200MB", "--dir", str(work)]
    args += ["--connections", "4"]  # the s3 tier's connections and every peer's alike
    doc = run_to_json(tmp_path, "object-store", *args)
    _assert_report(doc, "s3like", writable=False, connections=4)
    rows = doc["rows"]
    assert "(4 x 8 MiB)" in rows["load_boto3_ranges_cpu"]["label"]
    assert "(4 x 8 MiB)" in rows["load_obstore_ranges_cpu"]["label"]
    assert doc["setup"]["rate_bytes_per_s"] == 200_000_000
    assert list(work.iterdir()) == []  # nginx's directory too: it was stopped


def test_a_result_with_other_bytes_stops_the_bench(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The source's checksum is replaced by a wrong one: the first result checked must fail.
    import tierd_bench.objectstore as objectstore

    def wrong(path: Path, size: int) -> str:
        write_source(path, size)
        return "xxh3_128:" + "0" * 32

    monkeypatch.setattr(objectstore, "write_source", wrong)
    with pytest.raises(BytesMismatch, match="the bytes differ from the source"):
        run(1 << 20, "cpu", "moto", repeats=1, objects=1, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_check_bytes() -> None:
    check_bytes("same", "xxh3_128:ab", "xxh3_128:ab")
    with pytest.raises(BytesMismatch, match="a peer: the bytes differ"):
        check_bytes("a peer", "xxh3_128:ab", "xxh3_128:cd")


def test_source_parts_are_distinct(tmp_path: Path) -> None:
    # Every MiB is stamped with its index: parts written at the wrong offset change the sum.
    path = tmp_path / "s.bin"
    expected = write_source(path, 3 << 20)
    assert checksum_of_file(path) == expected and path.stat().st_size == 3 << 20
    data = path.read_bytes()
    assert len({data[i : i + (1 << 20)] for i in range(0, len(data), 1 << 20)}) == 3


@needs_nginx
def test_nginx_origin_speaks_enough_s3(tmp_path: Path) -> None:
    """HEAD, ranged GET pinned by If-Match, paginated listings with the HEAD's ETag, WebDAV
    PUT/DELETE; stopped and removed afterwards."""
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(100_000))
    with _origin.open_origin("open", parent=tmp_path) as org:
        org.put_file("p/model.bin", src)
        org.put_many({f"many/o{i:05d}": b"x" for i in range(1001)})
        c = org.client()
        head = c.head_object(Bucket=org.bucket, Key="p/model.bin")
        assert head["ContentLength"] == 100_000
        got = c.get_object(Bucket=org.bucket, Key="p/model.bin", Range="bytes=10-19",
                           IfMatch=head["ETag"])["Body"].read()  # fmt: skip
        assert got == src.read_bytes()[10:20]
        with pytest.raises(Exception, match="412"):
            c.get_object(Bucket=org.bucket, Key="p/model.bin", IfMatch='"0-1"')
        listed = c.list_objects_v2(Bucket=org.bucket, Prefix="p/")["Contents"]
        assert [(o["Key"], o["ETag"], o["Size"]) for o in listed] == [
            ("p/model.bin", head["ETag"], 100_000)
        ]
        pages = list(c.get_paginator("list_objects_v2").paginate(Bucket=org.bucket, Prefix="many/"))
        assert [len(p["Contents"]) for p in pages] == [1000, 1]
        assert c.list_objects_v2(Bucket=org.bucket, Prefix="other/").get("Contents") is None
        c.put_object(Bucket=org.bucket, Key="p/probe.tmp", Body=b"probe")
        c.delete_object(Bucket=org.bucket, Key="p/probe.tmp")
        served = org.served
    assert served is not None and not served.exists()


def test_missing_nginx_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_nginx, "NGINX", tmp_path / "no-nginx")
    with pytest.raises(OriginUnavailable, match="apt-get install nginx"):
        run(1 << 20, "cpu", "s3like", repeats=1, objects=1, directory=tmp_path)
    result = CliRunner().invoke(cli, ["bench", "object-store", "--origin", "s3like"])
    assert result.exit_code == 2 and "apt-get install nginx" in cli_text(result.output)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--origin", "open"], "--origin: only for --object-store"),
        (["object-store", "--origin", "ftp://x/b"], "use moto, s3like, open"),
        (["object-store", "--rate", "fast"], "not a size"),
        (["object-store", "--size", "4KiB"], "at least 1 MiB"),
        (["object-store", "--connections", "0"], "--connections"),
        (["object-store", "--connections", "2000"], "--connections"),
        (["object-store", "--samples", "0"], "--samples"),
        (["--connections", "8"], "--connections: only for --object-store"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["bench", *args])
    assert result.exit_code == 2 and message in cli_text(result.output)


def test_cpu_of_reads_a_process_cpu_from_proc() -> None:
    # What the REST rows add for the server: the same clock as process_time, for any pid.
    before = cpu_of(os.getpid())
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:
        pass
    assert 0.2 <= cpu_of(os.getpid()) - before <= 5


def test_runai_safetensors_variant_holds_the_object(tmp_path: Path) -> None:
    # Run:ai's streamer reads safetensors: the bench's variant is one bf16 tensor whose bytes
    # are the source's, behind a header safetensors itself accepts (8-byte aligned JSON).
    source = tmp_path / "source.bin"
    expected = write_source(source, 1 << 20)
    run = SimpleNamespace(size=1 << 20, source=source)
    path = tmp_path / "model.safetensors"
    _runai._write_safetensors(run, path)  # type: ignore[arg-type]
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert n % 8 == 0
    assert json.loads(data[8 : 8 + n]) == {
        "weight": {"dtype": "BF16", "shape": [1 << 19], "data_offsets": [0, 1 << 20]}
    }
    tail = tmp_path / "tail.bin"
    tail.write_bytes(data[8 + n :])
    assert checksum_of_file(tail) == expected


@pytest.mark.gpu
def test_bench_object_store_measures_cuda_and_cpu(tmp_path: Path, host_network: None) -> None:
    """On a GPU host, one run loads into cuda:0 and into cpu, each against its own peers, in
    process and over REST (CUDA IPC into this process for cuda)."""
    origin = "s3like" if _nginx.NGINX.exists() else "moto"
    report = run(2 << 20, "cuda:0", origin, repeats=1, objects=10, samples=10, directory=tmp_path)
    rows = report.rows
    assert report.setup["devices"] == ["cuda:0", "cpu"]
    for dev in ("cuda", "cpu"):
        load, rest = rows[f"load_tierd_{dev}"], rows[f"rest_tierd_{dev}"]
        assert load.value and rest.value, dev
        kvikio = rows[f"load_kvikio_{dev}"]
        assert load.vs == (f"load_kvikio_{dev}" if kvikio.value else f"load_best_{dev}"), dev
        assert rest.vs == f"load_tierd_{dev}" and isinstance(rest.met, bool), dev
        assert rows[f"load_boto3_ranges_{dev}"].value, dev
        alt, kv_alt = rows[f"load_tierd_alt_{dev}"], rows[f"load_kvikio_alt_{dev}"]
        if kvikio.value:  # taken in turns, each against the other
            assert alt.value and kv_alt.value and alt.vs == f"load_kvikio_alt_{dev}", dev
    assert rows["ceil_pinned_h2d"].value
    assert list(tmp_path.iterdir()) == []
