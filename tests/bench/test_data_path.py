"""``tierd bench`` end to end on a tiny file (host backend here), and its size parser."""

from __future__ import annotations

import pytest

from tierd_bench import parse_size, render
from tierd_bench.data_path import run_bench

from .test_report import assert_shared_shape


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1G", 10**9), ("4096", 4096), ("1.5KiB", 1536)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1", "4XB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_bench_runs_and_cleans_up(tmp_path):
    report = run_bench(
        2 << 20, "cpu", tmp_path, rows=64, shards=2, repeats=1, cold=False, sweep=False
    )
    rows = report.rows
    for key in ("base_fromfile", "tierd_hot", "lat_hot_p50", "tierd_gather", "tierd_safetensors"):
        assert rows[key].value and rows[key].value > 0, key
    assert rows["tierd_hot"].vs == "base_fromfile" and rows["tierd_hot"].ratio > 0
    # Every load row has its CPU cost beside it, and only load rows do.
    loads = [k for k, r in rows.items() if r.unit == "GB/s" and r.value is not None]
    assert {f"{k}_cpu" for k in loads} == {k for k, r in rows.items() if r.unit == "CPU-s/GB"}
    for key in loads:
        cpu = rows[f"{key}_cpu"]
        assert (
            cpu.value is not None
            and cpu.value >= 0
            and cpu.label.strip().endswith(rows[key].label.strip())
        )
    keys = list(rows)
    assert keys.index("tierd_hot_cpu") == keys.index("tierd_hot") + 1  # printed beside it
    assert (rows["tierd_hot_cpu"].value or 0) > 0  # reading 2 MiB takes some CPU
    assert report.setup["backend"] == "host" and report.setup["cold"] is False
    assert list(tmp_path.iterdir()) == []  # test files removed
    assert render(report).row_count == len(rows)
    assert_shared_shape(report.as_dict(), "data")


def test_bench_rejects_a_tiny_file(tmp_path):
    with pytest.raises(ValueError, match="at least 1 MiB"):
        run_bench(4096, "cpu", tmp_path)
