"""``tierd bench fleet`` end to end, tiny: two real tierd processes on the tests' PostgreSQL
(through ``--catalog-url``, in a scratch database) and moto. Only the result's shape, that every
measure ran and that every host's bytes were checked are asserted, never a speed; and the bench
leaves the server and its directory as it found them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from app.cli import cli
from tests.pg_support import PgServer
from tierd_bench.fleet import SAMPLE, FleetBenchUnavailable, _write_shard, run

from .test_report import assert_shared_shape

pytest.importorskip("moto.server", reason="moto[server] is not installed")

runner = CliRunner()
ROWS = [
    "hand_s", "fleet_s", "fleet_extra_s", "single_s", "hand_gbps", "fleet_gbps", "single_gbps",
]  # fmt: skip


def _said(output: str) -> str:
    return " ".join(output.replace("│", " ").split())


def _databases(server: PgServer) -> set[str]:
    return {r[0] for r in server.execute("postgres", "SELECT datname FROM pg_database")}


def test_two_hosts_by_hand_and_by_a_fleet_job(
    tmp_path: Path, pg_server: PgServer, pg_url: str
) -> None:
    before = _databases(pg_server)
    work, out = tmp_path / "work", tmp_path / "fleet.json"
    work.mkdir()
    args = ["--hosts", "2", "--shards", "2", "--size", "128KiB", "--runs", "1",
            "--poll-interval", "0.2", "--catalog-url", pg_url, "--dir", str(work)]  # fmt: skip
    result = runner.invoke(cli, ["bench", "fleet", *args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc: dict[str, Any] = json.loads(out.read_text())
    assert_shared_shape(doc, "fleet")
    rows, setup = doc["rows"], doc["setup"]
    assert list(rows) == ROWS
    for key in ROWS:
        if key != "fleet_extra_s":  # a difference: either sign is a result
            assert rows[key]["value"] > 0, rows[key]
    assert rows["fleet_s"]["vs"] == "hand_s" and rows["fleet_s"]["ratio"] > 0
    assert rows["fleet_gbps"]["vs"] == "hand_gbps"
    assert rows["hand_gbps"]["vs"] == "single_gbps"
    assert (setup["hosts"], setup["shards"], setup["runs"]) == (2, 2, 1)
    assert setup["size_bytes"] == 128 << 10 and setup["poll_interval_s"] == 0.2
    assert {k: len(v) for k, v in setup["seconds"].items()} == {"hand": 1, "fleet": 1, "single": 1}
    # The bytes check ran after every measure: the warm-up, by hand and fleet on both hosts,
    # and one host alone; each copy compared at both ends, on disk and over REST.
    copies = 2 + 2 * 2 + 2 * 2 + 2
    assert setup["checked"] == {
        "measures": 4,
        "copies": copies,
        "bytes_compared": copies * 4 * SAMPLE,
    }
    assert "scratch database" in setup["postgresql"]
    assert "fleet poll interval 0.2 s" in result.stdout
    assert "fleet: one POST /v1/fleet/prefetch to 2 hosts" in result.stdout
    # The scratch database is gone, the URL's own catalog untouched, the hosts' dirs removed.
    assert _databases(pg_server) == before
    dbname = make_url(pg_url).database
    assert dbname is not None
    assert pg_server.execute(dbname, "SELECT count(*) FROM files") == [(0,)]
    assert pg_server.execute(dbname, "SELECT count(*) FROM hosts") == [(0,)]
    assert list(work.iterdir()) == []


def test_a_shard_is_a_safetensors_file_of_the_size_asked(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for nbytes in (4 * SAMPLE, 4 * SAMPLE + 3, 100_001):
        path = tmp_path / f"s{nbytes}.safetensors"
        shard = _write_shard(path, nbytes, rng)
        data = path.read_bytes()
        assert shard.size == len(data) == nbytes
        assert (shard.head, shard.tail) == (data[:SAMPLE], data[-SAMPLE:])
        weight = load_file(str(path))["weight"]
        assert weight.dtype == np.uint8 and weight.tobytes() == data[-weight.size :]
        assert shard.head != shard.tail  # random bytes: a shifted copy would not match


def test_without_postgresql_it_asks_for_a_catalog_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no setpriv: no throwaway server
    with pytest.raises(FleetBenchUnavailable, match="pass --catalog-url"):
        run(128 << 10, 2, 2, 1, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--catalog-url", "sqlite:///tmp/x.db"], "must be postgresql+psycopg"),
        (["--catalog-url", "mysql://db/x"], "unsupported catalog URL"),
        (["--hosts", "0"], "--hosts"),
        (["--runs", "0"], "--runs"),
        (["--size", "8KiB"], "at least"),
        (["--poll-interval", "0"], "--poll-interval"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    result = runner.invoke(cli, ["bench", "fleet", *args])
    assert result.exit_code == 2 and message in _said(result.output)
