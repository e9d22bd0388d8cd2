"""``tierd bench object-store`` end to end, tiny sizes, against moto and (when Debian's nginx is
installed) the S3-like nginx origin; and the origin and byte checks it stands on.

Figures are never checked against a speed: only that every row is there, that tierd's rows
carry a ratio to their reference, that the bytes of every result were checked (a wrong
checksum stops the bench), and that nothing is left behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tiering.bench import _nginx, _origin
from tiering.bench._objrun import BytesMismatch, check_bytes, checksum_of_file, write_source
from tiering.bench._s3peers import SWEEP
from tiering.bench.objectstore import OriginUnavailable, run

from .test_cli_bench import run_to_json

pytest.importorskip("moto.server", reason="moto[server] is not installed")

needs_nginx = pytest.mark.skipif(
    not _nginx.NGINX.exists(), reason=f"Debian's nginx is not installed at {_nginx.NGINX}"
)

ARGS = ["--size", "2MiB", "--device", "cpu", "--repeats", "1", "--objects", "300"]
SWEEPS = [f"{kind}_boto3_{c}x{m}" for kind in ("promote", "demote") for c, m in SWEEP]
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
    "load_tierd",
    "load_boto3_ranges",
    "load_obstore_ranges",
    "load_s3fs",
    "load_kvikio",
    "load_best",
    "adopt_tierd",
}


def _assert_report(doc: dict[str, Any], origin: str, writable: bool) -> None:
    rows = doc["rows"]
    sweeps = set(SWEEPS) if writable else {k for k in SWEEPS if k.startswith("promote")}
    assert set(rows) == ROWS | sweeps
    assert doc["setup"]["origin"] == origin and doc["setup"]["checksum"].startswith("xxh3_128:")
    measured = ["promote_tierd", "load_tierd", "promote_boto3", "load_boto3_ranges"]
    measured += ["demote_tierd", "demote_boto3"] if writable else []
    for key in measured:
        assert isinstance(rows[key]["value"], float) and rows[key]["value"] > 0, key
    for key, vs in [("promote_tierd", "promote_best"), ("load_tierd", "load_best")] + (
        [("demote_tierd", "demote_boto3")] if writable else []
    ):
        assert rows[key]["vs"] == vs and isinstance(rows[key]["ratio"], float), key
        assert isinstance(rows[key]["met"], bool) and rows[key]["target"], key
    if not writable:
        assert rows["demote_tierd"]["value"] is None
        assert "read-only" in rows["demote_tierd"]["note"]
    adopt = rows["adopt_tierd"]
    assert adopt["unit"] == "objects/s" and adopt["value"] > 0 and isinstance(adopt["met"], bool)
    for key in ("promote_s3fs", "load_kvikio"):  # a peer that is absent says so
        assert rows[key]["value"] is not None or rows[key]["note"], key


def _work(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    return work


def test_bench_object_store_against_moto(tmp_path: Path) -> None:
    work = _work(tmp_path)
    args = ["object-store", *ARGS, "--origin", "moto", "--dir", str(work)]
    doc = run_to_json(tmp_path, "object-store", *args)
    _assert_report(doc, "moto", writable=True)
    assert list(work.iterdir()) == []  # the nvme tier, source and catalogs removed


@needs_nginx
def test_bench_object_store_flag_against_nginx_s3like(tmp_path: Path) -> None:
    work = _work(tmp_path)
    args = ["--object-store", *ARGS, "--origin", "s3like", "--rate", "200MB", "--dir", str(work)]
    doc = run_to_json(tmp_path, "object-store", *args)
    _assert_report(doc, "s3like", writable=False)
    assert doc["setup"]["rate_bytes_per_s"] == 200_000_000
    assert list(work.iterdir()) == []  # nginx's directory too: it was stopped


def test_a_result_with_other_bytes_stops_the_bench(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The source's checksum is replaced by a wrong one: the first result checked must fail.
    import tiering.bench.objectstore as objectstore

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
    assert result.exit_code == 2 and "apt-get install nginx" in " ".join(result.output.split())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--origin", "open"], "--origin: only for --object-store"),
        (["object-store", "--origin", "ftp://x/b"], "use moto, s3like, open"),
        (["object-store", "--rate", "fast"], "not a size"),
        (["object-store", "--size", "4KiB"], "at least 1 MiB"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["bench", *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split())
