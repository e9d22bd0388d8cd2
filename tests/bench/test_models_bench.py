"""``tierd bench models`` at a tiny size: a real server process, every row measured and its
bytes checked, the ratios set; the REST profile read from the server's ``Server-Timing``; and
fastsafetensors beside tierd where it is installed, a line saying why where it is not."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("safetensors")

from app.api.loads import server_timing  # noqa: E402
from tierd_bench._restprofile import CLIENT_PHASES, parse_server_timing  # noqa: E402
from tierd_bench.models import run  # noqa: E402

HAVE_FST = importlib.util.find_spec("fastsafetensors") is not None


def test_models_bench_measures_every_row_and_checks_bytes() -> None:
    pytest.importorskip("torch")
    report = run(8 << 20, "cpu", shards=3, repeats=1)
    rows = report.rows
    measured = ["model_load", "shards_serial", "rest_state_dict", "in_process_state_dict"]
    measured += ["rest_state_dict_memory", "prof_page_cache", "prof_memory"]
    assert all(rows[k].value is not None and rows[k].value > 0 for k in measured)
    assert rows["model_load"].vs == "shards_serial" and rows["model_load"].target == ">= 1x"
    assert rows["rest_state_dict"].vs == "in_process_state_dict"
    assert rows["rest_state_dict"].target == ">= 0.9x"
    assert report.setup["weight_bytes"] >= (8 << 20) - (1 << 16)
    assert rows["rest_state_dict_memory"].note.endswith("source: memory")
    # The profile: every client phase, and the server's phases from its Server-Timing header.
    for prefix, source in (("prof_page_cache", "page_cache"), ("prof_memory", "memory")):
        assert rows[prefix].note == f"(source: {source})"
        for phase in (*CLIENT_PHASES, "close"):
            assert rows[f"{prefix}_client_{phase}"].value is not None
        phases = ("load", "open", "read", "alloc", "io", "sync", "grant", "reply", "http")
        for phase in phases:
            assert rows[f"{prefix}_server_{phase}"].value is not None, phase
        server = {p: rows[f"{prefix}_server_{p}"].value for p in phases}
        # In ms; the header rounds to the microsecond.
        assert server["io"] <= server["read"] + 1e-3 and server["read"] <= server["load"] + 1e-3
    # One device only: no two-GPU rows, and the setup says why.
    assert not any(k.startswith(("tp2", "replicate2")) for k in rows)
    assert "2 GPUs" in report.setup["two_gpu"]
    fst = [rows["fst_default"], rows["fst_buffered"]]
    if HAVE_FST:
        assert all(r.value is not None and r.value > 0 for r in fst)
        assert rows["fst_buffered_x"].value == pytest.approx(
            rows["rest_state_dict"].value / rows["fst_buffered"].value
        )
    else:
        assert all(r.value is None and r.note.startswith("not installed") for r in fst)
        assert all("fastsafetensors" in r.note for r in fst)
        assert "fst_buffered_x" not in rows


def test_models_bench_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError):
        run(1 << 20, "cpu", shards=4)
    with pytest.raises(ValueError):
        run(8 << 20, "cpu", repeats=0)


def test_server_timing_round_trip() -> None:
    header = server_timing({"load": 0.0125, "read": 0.01, "reply": 0.0002})
    assert header == "load;dur=12.500, read;dur=10.000, reply;dur=0.200"
    assert parse_server_timing(header) == pytest.approx(
        {"load": 0.0125, "read": 0.01, "reply": 0.0002}
    )
    # Other servers' forms: a description, no duration, junk; none of it breaks the parse.
    other = 'cache;desc="hit";dur=2, db, x;dur=oops, ;dur=1'
    assert parse_server_timing(other) == pytest.approx({"cache": 0.002})
    assert parse_server_timing(None) == {}
