"""``tierd bench serving`` at a tiny size through the real CLI: a real tierd in its own process,
real clients, real moves and, where PostgreSQL and moto are here, real fills from a second
tierd. Only the report's shape and the checks' accounts are asserted, never a speed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tests.conftest import LiveServer, make_settings
from tests.helpers import cli_text
from tests.pg_support import PgServer
from tierd_bench._serving_fills import why_no_fills
from tierd_bench.serving import (
    DURATION_S,
    KINDS,
    REPEATS,
    RUNS,
    _set_policy,
    busy_phases,
    run,
)

from .test_cli_bench import run_to_json

TINY = ["--duration", "0.5", "--repeats", "1", "--runs", "1", "--clients", "3", "--movers", "1"]


@dataclass
class Served:
    doc: dict[str, Any]
    work: Path  # the bench's --dir
    databases: tuple[set[str], set[str]] | None  # the PostgreSQL server's, before and after


def _databases(server: PgServer) -> set[str]:
    return {r[0] for r in server.execute("postgres", "SELECT datname FROM pg_database")}


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Served]:
    """One tiny run of moves and peer fills, which the tests below read: a run of its own for
    the fills would start another server and its client processes (~6 s of the suite on two
    cores). The fills run on the tests' PostgreSQL (a scratch database the bench makes and
    drops) where it and moto are here; elsewhere the bench skips them, saying why."""
    tmp = tmp_path_factory.mktemp("serving")
    work = tmp / "work"
    work.mkdir()
    args = ["serving", *TINY, "--size", "256KiB", "--cap", "0", "--dir", str(work)]
    args += ["--phases", "moves,fills", "--fill-size", "1MiB"]
    pg: PgServer | None = None
    if why_no_fills(None) is None:
        pg = request.getfixturevalue("pg_server")
        args += ["--catalog-url", pg.url("postgres")]
    before = _databases(pg) if pg is not None else set()
    with pytest.MonkeyPatch.context() as mp:  # as the autouse _clean_env does for a test
        for key in [k for k in os.environ if k.startswith("TIERD_")]:
            mp.delenv(key)
        doc = run_to_json(tmp, "serving", *args)
    yield Served(doc, work, (before, _databases(pg)) if pg is not None else None)


def test_bench_serving_reports_both_phases_and_the_ratios(served: Served) -> None:
    doc, work = served.doc, served.work
    rows, setup = doc["rows"], doc["setup"]
    assert setup["clients"] == 3 and setup["move_size_bytes"] == 256 << 10
    assert setup["cap_bytes_per_s"] is None and "no cap" in doc["title"]
    assert doc["title"].startswith("tierd bench serving: 3 client processes over REST")
    [one] = setup["runs"]
    assert [w["phase"] for w in one["windows"]][:2] == ["idle", "moves"]
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


def test_bench_serving_fills_copies_from_a_peer_while_serving(served: Served) -> None:
    rows, setup = served.doc["rows"], served.doc["setup"]
    fills = setup["fills"]
    if "skipped" in fills:
        pytest.skip(f"peer fills not measured here: {fills['skipped']}")
    assert setup["phases"] == ["moves", "fills"]
    assert (fills["fillers"], fills["size_bytes"], fills["peer"]) == (1, 1 << 20, "bench-peer")
    assert "page_cache" in fills["trigger"] and "scratch database" in fills["catalog"]
    assert "while 1 files of 1 MiB fill from a peer's pieces" in served.doc["title"]
    [one] = setup["runs"]
    assert [w["phase"] for w in one["windows"]] == ["idle", "moves", "idle", "fills"]
    assert sum(w["fills"] for w in one["windows"] if w["phase"] == "fills") > 0
    # Every fill's bytes came from the peer, by both hosts' counters; each copy left at the
    # end of the fills with no client and of the window was hashed against the bucket's bytes.
    account = one["fills"]
    assert account["bucket_bytes_read"] == 0 and account["copies_checked"] == 2
    assert account["peer_bytes_served"] >= account["bytes_filled"] == account["fills"] << 20
    for name in ("all", *(k[0] for k in KINDS)):
        busy = rows[f"{name}_p99_fills_ms"]
        assert busy["vs"] == f"{name}_p99_idle_ms" and busy["target"] is None
        assert busy["ratio"] == pytest.approx(busy["value"] / rows[f"{name}_p99_idle_ms"]["value"])
    assert rows["rate_fills"]["vs"] == "rate_idle" and rows["rate_fills"]["ratio"] > 0
    fill = rows["fill_s_fills"]
    assert fill["vs"] == "fill_s_alone" and fill["ratio"] > 0 and fill["target"] is None
    assert served.databases is not None
    before, after = served.databases
    assert after == before  # the scratch catalog was dropped


def test_the_clis_defaults_are_the_benchs() -> None:
    """60 s of each phase a run, in alternating windows, three runs (issue 43's measurement,
    medians of three): the CLI states
    the defaults itself, as it imports the bench only when it runs."""
    import inspect

    from tierd_bench._cliserving import bench_serving

    cli_defaults = inspect.signature(bench_serving).parameters
    run_defaults = inspect.signature(run).parameters
    assert cli_defaults["duration"].default == run_defaults["duration_s"].default == DURATION_S
    assert cli_defaults["repeats"].default == run_defaults["repeats"].default == REPEATS
    assert cli_defaults["runs"].default == run_defaults["runs"].default == RUNS == 3
    assert DURATION_S * REPEATS == 60


def test_phases_are_chosen_and_checked() -> None:
    assert busy_phases(None, None) == ["moves"]
    assert busy_phases(["fills", "moves"], "open") == ["moves", "fills", "load"]
    with pytest.raises(ValueError, match="unknown phases nap"):
        busy_phases(["nap"], None)
    with pytest.raises(ValueError, match="needs an origin"):
        busy_phases(["load"], None)
    assert why_no_fills("sqlite:///catalog.db") == "--catalog-url must be postgresql+psycopg://..."


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
        (["--phases", "moves,nap"], "unknown phases nap"),
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
    args = [
        "serving",
        *TINY[:2],
        "--repeats",
        "1",
        "--runs",
        "1",
        "--clients",
        "2",
        "--movers",
        "1",
    ]
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
