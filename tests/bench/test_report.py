"""The shared result model, table and JSON writer of every ``tierd bench`` sub-benchmark."""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from tierd_bench import BenchRow, Report, format_size, print_report, render, write_json
from tierd_bench._measure import percentile

ROW_KEYS = {f.name for f in dataclasses.fields(BenchRow)}


def assert_shared_shape(doc: dict[str, Any], bench: str) -> None:
    """What every sub-benchmark's JSON holds, whichever it is."""
    assert set(doc) == {"bench", "title", "machine", "setup", "rows"}
    assert doc["bench"] == bench and doc["title"].startswith(f"tierd bench {bench}")
    assert {"platform", "cpus", "python", "time"} <= set(doc["machine"])
    assert doc["rows"], "no figures"
    for key, row in doc["rows"].items():
        assert set(row) == ROW_KEYS and row["key"] == key
        assert row["vs"] is None or row["vs"] in doc["rows"]
        assert row["value"] is None or isinstance(row["value"], int | float)


def _report(long: str = "") -> Report:
    report = Report("demo", "tierd bench demo: a title " + long, {"size_bytes": 1})
    report.add(BenchRow("base", "a baseline " + long, 2.0, "GB/s", note="(a note) " + long))
    report.add(BenchRow("ours", "ours, hot " + long, 5.0, "GB/s"))
    report.add(BenchRow("skipped", "a peer that is not installed", None, "GB/s"))
    report.add(BenchRow("nan", "a figure that could not be taken", float("nan"), "us"))
    report.compare("ours", "base", at_least=2.0)
    report.compare("skipped", "base")  # a missing figure is no error
    return report


def test_compare_sets_ratio_target_and_verdict() -> None:
    report = _report()
    ours = report.rows["ours"]
    assert (ours.vs, ours.ratio, ours.target, ours.met) == ("base", 2.5, ">= 2x", True)
    assert report.rows["skipped"].ratio is None


def test_json_has_the_shared_shape_and_no_nan(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    write_json(_report(), path)
    doc = json.loads(path.read_text())  # json.loads would accept NaN; the check is below
    assert_shared_shape(doc, "demo")
    assert doc["rows"]["nan"]["value"] is None and "NaN" not in path.read_text()
    assert doc["setup"] == {"size_bytes": 1}


def test_table_off_a_terminal_keeps_each_row_on_one_line() -> None:
    # Cells far wider than the 80 columns rich assumes off a terminal.
    long = "x" * 150
    report = _report(long)
    out = io.StringIO()  # not a terminal, like a log, CI or `| tee`
    print_report(report, out)
    lines = out.getvalue().splitlines()
    assert lines[0] == report.title
    assert lines[1].startswith("machine: ")
    body = [line for line in lines if line.startswith("│")]
    assert len(body) == len(report.rows)  # one line per row: nothing folded onto a second line
    for line, row in zip(body, report.rows.values(), strict=True):
        assert row.label in line
    assert any(f"(a note) {long}" in line for line in body)
    # Every line of the table is as wide as its top border: a real table, not fragments.
    table = [line for line in lines[2:] if line]
    assert len({len(line) for line in table}) == 1 and len(table[0]) > 300


def test_table_on_a_narrow_terminal_fits_it() -> None:
    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=True, color_system=None)
    console.print(render(_report("y" * 150)))
    assert max(len(line) for line in out.getvalue().splitlines()) <= 100


def test_a_note_that_looks_like_markup_is_printed_as_it_is() -> None:
    # gloo's errors quote their source as "[/path/pair.cc:553]": rich markup would raise.
    note = "rank 1 failed: [/opt/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    out = io.StringIO()
    print_report(_report(note), out)
    assert "[/opt/gloo/transport/tcp/pair.cc:553]" in out.getvalue()


def test_render_has_one_row_per_figure() -> None:
    report = _report()
    assert render(report).row_count == len(report.rows)


@pytest.mark.parametrize(
    ("samples", "q", "expected"),
    [([1.0], 99, 1.0), ([1.0, 2.0, 3.0, 4.0], 50, 2.5), ([0.0, 10.0], 99, 9.9)],
)
def test_percentile_interpolates_like_numpy(samples: list[float], q: float, expected: float):
    assert percentile(samples, q) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("nbytes", "text"), [(4 << 30, "4 GiB"), (3 << 19, "1.50 MiB"), (4096, "4 KiB"), (7, "7 B")]
)
def test_format_size(nbytes: int, text: str) -> None:
    assert format_size(nbytes) == text


def test_importing_the_package_stays_light() -> None:
    # The CLI imports tierd_bench to register its commands: that must not pull in the data
    # path, the engine, CUDA libraries or the server.
    code = (
        "import sys, tierd_bench; "
        "heavy = [m for m in ('tiering.io', 'tiering.engine', 'cupy', 'torch', 'kvikio', "
        "'fastapi', 'uvicorn', 'sqlalchemy', 'tierd_client') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_bench_module_follows_the_house_rules() -> None:
    # Docstring, postponed annotations and an explicit __all__, read from the source so that
    # the GPU-only modules are checked on this host too.
    root = Path(__file__).resolve().parents[2] / "tiering" / "bench"
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), path.name
        future = [
            n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"
        ]
        assert future and future[0].names[0].name == "annotations", path.name
        names = {
            t.id
            for n in tree.body
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        assert "__all__" in names, path.name
