"""``tierd bench`` and its sub-benchmarks through the real CLI, on this host's CPU, tiny sizes.

Figures are never checked against a speed: only that each sub-benchmark runs, prints its
table one line per row (the runner's output is not a terminal), and writes the shared JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tests.helpers import cli_text

from .test_report import assert_shared_shape

runner = CliRunner()


def bench(*args: str) -> str:
    result = runner.invoke(cli, ["bench", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def run_to_json(
    tmp_path: Path, bench_name: str, *args: str, flag: str = "--json"
) -> dict[str, Any]:
    out = tmp_path / "out.json"
    table = bench(*args, flag, str(out))
    doc: dict[str, Any] = json.loads(out.read_text())
    assert_shared_shape(doc, bench_name)
    lines = table.splitlines()
    assert lines[0] == doc["title"]
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == len(doc["rows"])  # one line per row, however wide
    for line, row in zip(rows, doc["rows"].values(), strict=True):
        assert row["label"].strip() in line
    return doc


def test_help_lists_the_sub_benchmarks() -> None:
    text = " ".join(bench("--help").split())
    for name in ("data", "access", "mover", "rest", "serving", "--access", "--size", "--json"):
        assert name in text
    for sub, option in (
        ("access", "--files"),
        ("mover", "--dst"),
        ("rest", "--small"),
        ("serving", "--movers"),
    ):
        assert option in bench(sub, "--help")


def _data_args(tmp_path: Path) -> list[str]:
    work = tmp_path / "work"
    work.mkdir()
    return ["--size", "2MiB", "--device", "cpu", "--dir", str(work), "--rows", "32"]


def test_plain_bench_is_the_data_path(tmp_path: Path) -> None:
    args = [*_data_args(tmp_path), "--shards", "2", "--repeats", "1", "--no-cold"]
    doc = run_to_json(tmp_path, "data", *args)
    assert doc["setup"]["device"] == "cpu" and doc["rows"]["tierd_hot"]["value"] > 0


def test_bench_data(tmp_path: Path) -> None:
    args = ["data", *_data_args(tmp_path), "--shards", "1", "--repeat", "1", "--no-cold"]
    doc = run_to_json(tmp_path, "data", *args)
    assert doc["setup"]["shards"] == 1 and "tierd_safetensors" in doc["rows"]


def test_bench_access(tmp_path: Path) -> None:
    args = ["access", "--files", "120", "--accesses", "2000", "--reads", "20", "--repeats", "1"]
    doc = run_to_json(tmp_path, "access", *args)
    assert doc["setup"]["files"] == 120 and doc["rows"]["record_per_s"]["value"] > 0


def test_bench_mover(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    args = ["mover", "--size", "1MiB", "--src", str(src), "--dst", str(dst), "--repeats", "1"]
    doc = run_to_json(tmp_path, "mover", *args, "--cap", "0")
    assert doc["rows"]["a_b_copy"]["vs"] == "a_b_cp" and "capped_move" not in doc["rows"]
    assert list(src.iterdir()) == [] and list(dst.iterdir()) == []  # cleaned up


def test_bench_rest_on_cpu(tmp_path: Path) -> None:
    # Starts a real tierd in its own process and loads through tierd_client.
    args = ["rest", "--size", "1MiB", "--device", "cpu", "--repeats", "1", "--small", "5"]
    doc = run_to_json(tmp_path, "rest", *args, flag="--out")
    assert doc["rows"]["rest_gbps"]["vs"] == "in_process_gbps"
    assert doc["setup"]["io_path_rest"] == ["host"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--size", "4GiB", "rest"], "--size must come after the sub-command"),
        (["data", "--size", "12XB"], "not a size"),
        (["data", "--size", "4KiB"], "at least 1 MiB"),
        (["mover", "--src", "/nonexistent/dir"], "not a directory"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    result = runner.invoke(cli, ["bench", *args])
    assert result.exit_code == 2 and message in cli_text(result.output)
