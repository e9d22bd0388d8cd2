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
    [one] = setup["runs"]
    assert [w["phase"] for w in one["windows"]] == ["idle", "moves", "idle", "moves"]
    assert len(one["loadavg_1m"]) == 2
    for name in ("all", *(k[0] for k in KINDS)):
        idle, busy = rows[f"{name}_p99_idle_ms"], rows[f"{name}_p99_moves_ms"]
        assert idle["unit"] == busy["unit"] == "ms" and "requests a run" in idle["note"]
        assert busy["vs"] == f"{name}_p99_idle_ms"
        assert busy["ratio"] == pytest.approx(busy["value"] / idle["value"])
    assert rows["read_4k_p99_moves_ms"]["target"] == rows["all_p99_moves_ms"]["target"] == "<= 1.5x"
    for q in ("p50", "p999"):
        assert rows[f"read_4k_{q}_moves_ms"]["vs"] == f"read_4k_{q}_idle_ms"
    rate = rows["rate_moves"]
    assert rate["vs"] == "rate_idle" and rate["target"] == ">= 0.8x" and rate["ratio"] > 0
    move = rows["move_s_moves"]
    assert move["vs"] == "move_s_alone" and move["target"] == "<= 1.5x" and move["ratio"] > 0
    assert rows["server_cpu_idle"]["unit"] == "cores" and "load_s_load" not in rows
    assert sum(w["moves"] for w in one["windows"] if w["busy"]) > 0
    assert list(work.iterdir()) == []  # the data dir is gone


def test_runs_are_combined_into_medians_and_every_run_must_meet_a_target() -> None:
    from tierd_bench._serving_clients import Sample
    from tierd_bench._serving_report import RunResult, Window, build_report

    def one(busy_ms: float, busy_rate: int) -> RunResult:
        """Idle: 100 reads of 10 ms in 1 s; moves: ``busy_rate`` reads of ``busy_ms``."""
        idle, moves = Window("idle", 0.0, 1.0), Window("moves", 1.0, 2.0)
        samples = [Sample(0, 0.001 * i, 0.001 * i + 0.01, 0.01) for i in range(100)]
        samples += [
            Sample(0, 1.0 + 0.001 * i, 1.0 + 0.001 * i + 0.01, busy_ms / 1e3)
            for i in range(busy_rate)
        ]
        return RunResult([idle, moves], samples, moves=[(1.1, 1.3)], alone=[(0.0, 0.1)])

    setup = {"clients": 1, "movers": 1, "move_size_bytes": 1, "repeats": 1, "duration_s": 1}
    report = build_report(setup, [one(12, 90), one(20, 85), one(13, 70)])
    p99 = report.rows["read_4k_p99_moves_ms"]
    assert p99.ratio == pytest.approx(1.3) and p99.value == pytest.approx(13)
    assert p99.met is False and p99.note.startswith("runs: 1.20x, 2.00x, 1.30x")
    rate = report.rows["rate_moves"]
    assert rate.ratio == pytest.approx(0.85) and rate.met is False  # the third run: 0.70x
    assert report.rows["move_s_moves"].ratio == pytest.approx(2.0)


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


# Clients, a server, nginx and a load's stream at once: 15 CPU-seconds of the suite's time on
# two cores; the serving bench's phases and ratios are tested above on every run.
@pytest.mark.slow
def test_bench_serving_during_a_large_load_from_a_fast_origin(tmp_path: Path) -> None:
    from tierd_bench._nginx import OriginUnavailable, require

    try:
        require("open")
    except OriginUnavailable as exc:
        pytest.skip(str(exc))
    work = tmp_path / "work"
    work.mkdir()
    args = ["serving", *TINY[:2], "--repeats", "1", "--clients", "2", "--movers", "1"]
    args += ["--size", "256KiB", "--origin", "open", "--load-size", "2MiB", "--dir", str(work)]
    doc = run_to_json(tmp_path, "serving", *args)
    rows, setup = doc["rows"], doc["setup"]
    assert setup["load"] == {"origin": "open", "size_bytes": 2 << 20, "device": "cpu"}
    [one] = setup["runs"]
    assert [w["phase"] for w in one["windows"]] == ["idle", "moves", "idle", "load"]
    assert "from the open origin into cpu" in doc["title"]
    p99 = rows["read_4k_p99_load_ms"]
    assert p99["vs"] == "read_4k_p99_idle_ms" and p99["target"] == "<= 3x"
    assert rows["load_s_load"]["vs"] == "load_s_alone" and rows["load_s_alone"]["value"] > 0
    assert list(work.iterdir()) == []
