"""``tierd bench models`` at a tiny size: a real server process, both rows measured and their
bytes checked, the ratio set against the per-shard loads."""

from __future__ import annotations

import pytest

pytest.importorskip("safetensors")

from tierd_bench.models import run  # noqa: E402


def test_models_bench_measures_both_and_checks_bytes() -> None:
    report = run(8 << 20, "cpu", shards=3, repeats=1)
    rows = report.rows
    assert set(rows) == {"model_load", "shards_serial"}
    assert all(r.value is not None and r.value > 0 for r in rows.values())
    assert rows["model_load"].vs == "shards_serial" and rows["model_load"].target == ">= 1x"
    assert report.setup["weight_bytes"] >= (8 << 20) - (1 << 16)


def test_models_bench_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError):
        run(1 << 20, "cpu", shards=4)
    with pytest.raises(ValueError):
        run(8 << 20, "cpu", repeats=0)
