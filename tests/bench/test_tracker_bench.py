"""``tierd bench tracker`` at a tiny fleet on the throwaway PostgreSQL: every row measured."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tests.helpers import cli_text
from tierd_bench._postgres import why_no_postgresql
from tierd_bench.tracker import run


def test_a_tiny_fleet_is_measured() -> None:
    if (why := why_no_postgresql()) is not None:
        pytest.skip(why)
    report = run([2], 64 << 20, seconds=0.5, workers=1)
    rows = report.rows
    assert rows["n2_events"].value and rows["n2_events"].value > 0
    for key in ("n2_polls", "n2_read_p50", "n2_read_p99", "n2_rollout", "n2_pg_per_poll"):
        assert rows[key].value is not None and rows[key].value > 0, key
    assert rows["n2_late_p99"].value is not None and rows["n2_blocked"].value is not None
    assert rows["n2_wal"].value is not None and rows["n2_wal"].value > 0


def test_bad_host_counts_are_usage_errors() -> None:
    result = CliRunner().invoke(cli, ["bench", "tracker", "--hosts", "0,x"])
    assert result.exit_code == 2 and "--hosts" in cli_text(result.output)
