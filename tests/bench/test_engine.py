"""``tierd bench engine`` on cpu at a tiny size: every row's fresh processes run (tierd from the
page cache and from the memory tier; with ``--runslow`` also from_pretrained and a restart after
a shared start; fastsafetensors and the two-GPU rows say why they are skipped), each process
checked every tensor of its model against the files, and every row's first token is the same.
Speeds are not asserted. The peer row (two hosts, PostgreSQL, an S3 origin): ``--runslow``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from tierd_bench._engine_model import llama_shape  # noqa: E402
from tierd_bench._engine_rows import PHASES  # noqa: E402
from tierd_bench._postgres import why_no_postgresql  # noqa: E402
from tierd_bench.cli import bench_cli  # noqa: E402
from tierd_bench.engine import run  # noqa: E402

HAVE_FST = importlib.util.find_spec("fastsafetensors") is not None
SIZE = 2 << 20


def _checked(report: object, key: str) -> None:
    """Every process of row ``key`` ran and compared all of the model's bytes."""
    setup = report.setup  # type: ignore[attr-defined]
    runs = setup["processes"][key]
    assert runs, key
    assert all(r["checked_bytes"] == setup["weight_bytes"] for r in runs), key


# Each row's process imports torch and transformers afresh (5-8 s of CPU each on two cores):
# CI runs tierd's rows, both of its sources (the page cache, the memory tier) and every phase,
# and the rows that say why they are skipped; from_pretrained's row (the ratios' reference) and
# the restart rows (a shared start, then two restarted processes) run with --runslow, as the
# kept-copy hand-over is tested in tests/serving/test_residency_keep.py and test_kept_copies.py.
QUICK = ("fastsafetensors", "tierd", "replicas")


@pytest.mark.parametrize(
    "rows",
    [QUICK, pytest.param(("from_pretrained", *QUICK, "restart"), marks=pytest.mark.slow)],
    ids=["ci", "all"],
)
def test_every_row_runs_and_loads_the_right_weights(tmp_path: Path, rows: tuple[str, ...]) -> None:
    report = run(SIZE, "cpu", repeats=1, directory=tmp_path, rows=rows)
    r, setup = report.rows, report.setup
    assert setup["weight_bytes"] == llama_shape(SIZE).weight_bytes
    reference = "from_pretrained" in rows
    measured = ["page_cache", "memory"]
    measured += ["from_pretrained"] if reference else []
    measured += ["first_start", "restart", "restart_plain"] if "restart" in rows else []
    measured += ["fastsafetensors"] if HAVE_FST else []
    for key in measured:
        _checked(report, key)
        assert r[key].value is not None and r[key].value > 0, key
        # Every phase (from_pretrained makes no loader and builds the model as it loads).
        for phase in PHASES:
            if phase not in ("setup", "construct") or key != "from_pretrained":
                assert r[f"{key}_{phase}"].value is not None, (key, phase)
        assert 0 < r[f"{key}_load"].value < r[key].value
        if key != "from_pretrained":
            # Ratios to from_pretrained where it ran; none (not a made-up one) where not.
            assert (r[key].vs == "from_pretrained") is reference
            assert (r[key].ratio is not None) is reference
            assert (r[f"{key}_load"].vs == "from_pretrained_load") is reference
    assert "from_pretrained_construct" not in r and "from_pretrained_setup" not in r
    if reference:  # tierd's lowest against the others' lowest needs another loader's row
        assert r["target_lowest_ttft"].value is not None and r["target_lowest_load"].value
    else:
        assert "target_lowest_ttft" not in r and "target_lowest_load" not in r
    # One model, one prompt: every row's first token is the same.
    assert len({t for ts in setup["first_tokens"].values() for t in ts}) == 1
    assert set(setup["first_tokens"]) >= set(measured)
    # Where tierd's bytes came from, read from the server's metrics.
    assert "page_cache" in r["page_cache"].note and "memory" in r["memory"].note
    if not HAVE_FST:
        assert r["fastsafetensors"].value is None
        assert r["fastsafetensors"].note.startswith("not installed")
    for key in ("replicas_memory", "replicas_fst", "tp2"):
        assert r[key].value is None and "two GPUs" in r[key].note
    # No GPU: no ceiling, and no target rows that need one.
    assert "ceiling" not in r and "target_memory_vs_ceiling" not in r


@pytest.mark.slow
def test_the_peer_row_loads_from_the_host_that_holds_the_files(tmp_path: Path) -> None:
    if why_no_postgresql() is not None:
        pytest.skip(f"no PostgreSQL: {why_no_postgresql()}")
    report = run(SIZE, "cpu", repeats=1, directory=tmp_path, rows=("peer",))
    _checked(report, "peer")
    note = report.rows["peer"].note
    assert "by source: peer" in note and "," not in note.partition("by source:")[2]


def test_the_command_refuses_an_unknown_row() -> None:
    result = CliRunner().invoke(bench_cli, ["engine", "--rows", "tierd,nope"])
    assert result.exit_code == 2
    assert "--rows" in result.output


def test_the_shape_follows_the_size() -> None:
    big = llama_shape(8 * 10**9)
    assert (big.hidden, big.intermediate, big.kv_heads) == (4096, 11008, 8)
    assert abs(big.weight_bytes - 8 * 10**9) < big.weight_bytes / big.layers
    small = llama_shape(SIZE)
    assert small.layers >= 4 and small.weight_bytes < 4 * SIZE
