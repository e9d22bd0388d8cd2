"""``tierd bench restart``: client processes that restart against a real server, each load's
source and bytes checked by the bench itself (GPU only); on ``cpu`` it refuses clearly. Speed
is never asserted."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tierd_bench.restart import run


def test_restart_bench_needs_a_gpu() -> None:
    with pytest.raises(RuntimeError, match="needs a GPU"):
        run(4 << 20, "cpu")
    result = CliRunner().invoke(cli, ["bench", "restart", "--size", "2MiB", "--device", "cpu"])
    assert result.exit_code == 2 and "needs a GPU" in result.output


@pytest.mark.gpu
def test_restart_bench_measures_each_row_on_a_gpu() -> None:
    pytest.importorskip("torch")
    report = run(64 << 20, "cuda:0", repeats=1)
    rows = report.rows
    for key in ("memory", "first_start", "restart_shared", "restart_copy"):
        assert rows[key].value is not None and rows[key].value > 0, key
    assert rows["kept_bytes"].met  # the first process's copy outlived it
    assert rows["restart_shared"].vs == "memory" and rows["restart_shared"].target == ">= 5x"
