"""``tierd bench memory`` at a tiny size on ``cpu``: the ceiling, the page-cache path and the
memory tier are measured (each load's source and bytes checked by the bench itself), with
their CPU cost and the ratios set against the issue's targets. Speed is never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tierd_bench.memory import run


def test_memory_bench_measures_each_path_on_cpu() -> None:
    report = run(4 << 20, "cpu", repeats=1)
    rows = report.rows
    for key in ("ceiling", "page_cache", "memory"):
        assert rows[key].value is not None and rows[key].value > 0, key
        assert rows[f"{key}_cpu"].unit == "CPU-s/GB"
    assert rows["memory_vs_ceiling"].target == ">= 0.95x"
    assert rows["memory_cpu_vs_page_cache"].target == "<= 0.1x"
    assert "resident_gpu" not in rows  # a cpu run has no GPU to hold copies


def test_memory_bench_from_the_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    result = CliRunner().invoke(
        cli, ["bench", "memory", "--size", "2MiB", "--device", "cpu", "--repeats", "1",
              "--json", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert set(doc["rows"]) >= {"ceiling", "page_cache", "memory"}


def test_memory_bench_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError):
        run(1000, "cpu")
    with pytest.raises(ValueError):
        run(4 << 20, "cpu", repeats=0)
