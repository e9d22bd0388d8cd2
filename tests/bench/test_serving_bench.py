"""``tierd bench serving`` at a tiny size through the real CLI: a real tierd in its own process,
real clients and real moves. Only the report's shape is checked, never a speed."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tests.conftest import LiveServer, make_settings
from tests.helpers import cli_text
from tierd_bench.serving import KINDS, _set_policy, run

from .test_cli_bench import run_to_json

TINY = ["--duration", "0.5", "--repeats", "2", "--clients", "3", "--movers", "1"]


def test_bench_serving_reports_both_phases_and_the_ratios(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    args = ["serving", *TINY, "--size", "256KiB", "--cap", "0", "--dir", str(work)]
    doc = run_to_json(tmp_path, "serving", *args)
    rows, setup = doc["rows"], doc["setup"]
    assert setup["clients"] == 3 and setup["move_size_bytes"] == 256 << 10
    assert setup["cap_bytes_per_s"] is None and "no cap" in doc["title"]
    assert doc["title"].startswith("tierd bench serving: 3 client processes over REST")
    assert [w["busy"] for w in setup["windows"]] == [False, True, False, True]
    for name in ("all", *(k[0] for k in KINDS)):
        idle, busy = rows[f"{name}_p99_idle_ms"], rows[f"{name}_p99_busy_ms"]
        assert idle["unit"] == busy["unit"] == "ms" and "p50" in idle["note"]
        assert busy["vs"] == f"{name}_p99_idle_ms" and busy["target"] == "<= 1.5x"
        assert busy["ratio"] == pytest.approx(busy["value"] / idle["value"])
    rate = rows["rate_busy"]
    assert rate["vs"] == "rate_idle" and rate["target"] == ">= 0.8x" and rate["ratio"] > 0
    assert rows["server_cpu_idle"]["unit"] == "cores" and rows["moved_mib_s"]["unit"] == "MiB/s"
    assert sum(w["moves"] for w in setup["windows"] if w["busy"]) > 0
    assert list(work.iterdir()) == []  # the data dir is gone


def test_bench_serving_keeps_the_policys_cap_by_default(tmp_path: Path) -> None:
    # The bench's policy step against a tierd in-process (a whole run takes ~10 s of suite).
    with LiveServer(make_settings(tmp_path / "data", watch=False)) as srv, srv.client() as http:
        assert _set_policy(http, "policy", 3) == 256 << 20  # the policy's default
        doc = http.get("/v1/policy").json()["policy"]
        assert doc["enabled"] is False and doc["concurrency"] >= 3
        assert _set_policy(http, 0, 1) is None
        assert _set_policy(http, 64, 1) == 64 << 20


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--duration", "0"], "Invalid value for '--duration'"),
        (["--clients", "0"], "Invalid value for '--clients'"),
        (["--size", "1XB"], "not a size"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["bench", "serving", *args])
    assert result.exit_code == 2 and message in cli_text(result.output)


def test_run_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="positive"):
        run(0)
