"""The one-process-per-rank loads of ``tierd bench models`` (its two-GPU rows) run on two
``cpu`` ranks joined by gloo: tierd over REST from a real server, and fastsafetensors where it
is installed. Each rank's bytes are checked against checksums computed from the files, and a
wrong expectation is caught, so the check can fail."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("torch")

from safetensors.numpy import save_file  # noqa: E402

from tierd_bench import models  # noqa: E402
from tierd_bench._modelpeers import _none, two_gpu_rows  # noqa: E402
from tierd_bench._peerranks import expected_digests, ranks  # noqa: E402
from tierd_bench._report import Report, print_report  # noqa: E402
from tierd_bench.rest import server_process  # noqa: E402
from tiering.checksum import Hasher  # noqa: E402

HAVE_FST = importlib.util.find_spec("fastsafetensors") is not None


def _shards(root: Path) -> list[Path]:
    rng = np.random.default_rng(5)
    paths = []
    for s in range(2):
        p = root / "nvme" / "m" / f"s{s}.safetensors"
        p.parent.mkdir(parents=True, exist_ok=True)
        # Odd row counts too: the ranks' blocks are ceil(rows / 2), the last one shorter.
        save_file({f"l{s}.w{t}": rng.standard_normal((5 + 2 * t, 3), np.float32) for t in range(3)},
                  str(p))  # fmt: skip
        paths.append(p)
    return paths


def test_expected_digests_are_chunks_of_the_tensors(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    paths = _shards(tmp_path)
    tensors = {k: v for p in paths for k, v in load_file(str(p)).items()}
    for mode in ("tp", "replicate"):
        want = []
        for rank in range(2):
            h = Hasher()
            for name in sorted(tensors):
                t = tensors[name]
                block = -(-t.shape[0] // 2)
                part = t if mode == "replicate" else t[rank * block : (rank + 1) * block]
                h.update(np.ascontiguousarray(part).tobytes())
            want.append(h.value())
        assert expected_digests(paths, 2, mode) == want
    assert len(set(expected_digests(paths, 2, "tp"))) == 2
    with pytest.raises(ValueError):
        expected_digests(paths, 2, "pipeline")


# Two gloo ranks, each importing torch and loading over REST: ~20 CPU-seconds on the 2-core CI
# machine, the suite's tightest budget. The per-rank checks above run in every suite.
@pytest.mark.slow
def test_two_device_rows_and_a_wrong_expectation(tmp_path: Path) -> None:
    """``tierd bench models``' two-GPU rows, run on two ``cpu`` ranks: tierd per rank over
    REST, fastsafetensors where installed, their ratio; then a wrong checksum is caught."""
    models._write_model(tmp_path / "nvme", 8 << 20, 4)
    files = sorted((tmp_path / "nvme" / models.NAME).glob("*.safetensors"))
    rel = [f"{models.NAME}/{p.name}" for p in files]
    report = Report("models", "test")
    with server_process(tmp_path) as (url, _):
        two_gpu_rows(report, url, files, rel, 1 << 20, ["cpu", "cpu"], 1, lambda s: None)
        rows = report.rows
        for mode in ("tp2", "replicate2"):
            assert rows[f"{mode}_tierd"].value > 0, rows[f"{mode}_tierd"].note
            assert rows[f"{mode}_tierd"].note.endswith("source: page_cache")
            if HAVE_FST:
                assert rows[f"{mode}_fst"].value > 0, rows[f"{mode}_fst"].note
                assert rows[f"{mode}_x"].value == pytest.approx(
                    rows[f"{mode}_tierd"].value / rows[f"{mode}_fst"].value
                )
            else:
                assert rows[f"{mode}_fst"].value is None
                assert rows[f"{mode}_fst"].note.startswith("not installed")
        # Each rank's checksum is the other mode's: the ranks' bytes are checked, and differ.
        wrong = expected_digests(files, 2, "replicate")
        with pytest.raises(AssertionError, match="differ"):
            ranks("tierd", ["cpu", "cpu"], "tp", 1, wrong, {"url": url, "paths": rel})
    with pytest.raises(ValueError):
        ranks("tierd", ["cpu"], "tp", 1, wrong[:1], {"url": url, "paths": rel})
    two_gpu_rows(report := Report("models", "test"), url, files, rel, 1, None, 1, print)
    assert report.rows == {} and "2 GPUs" in report.setup["two_gpu"]


@pytest.mark.slow  # two more gloo ranks (10 s); the rows' own test above runs in every suite
def test_a_failed_rank_is_a_printable_note(tmp_path: Path) -> None:
    """A rank that fails gives its row no figure and the error as its note, which the table
    prints as it is (gloo's errors hold "[/path:line]", which rich would take for markup)."""
    models._write_model(tmp_path / "nvme", 8 << 20, 4)
    files = sorted((tmp_path / "nvme" / models.NAME).glob("*.safetensors"))
    report = Report("models", "test")
    # Nothing listens at this URL: every tierd rank fails to connect.
    two_gpu_rows(report, "http://127.0.0.1:9", files, ["x"], 1, ["cpu", "cpu"], 1, print)
    row = report.rows["tp2_tierd"]
    assert row.value is None and row.note.startswith("failed: RuntimeError: rank")
    _none(report, "gloo", "gloo's words", "failed: RuntimeError: [/pair.cc:553] closed")
    out = io.StringIO()
    print_report(report, file=out)
    assert "failed: RuntimeError: rank" in out.getvalue()
    assert "[/pair.cc:553] closed" in out.getvalue()


def test_fastsafetensors_ranks_checked(tmp_path: Path) -> None:
    pytest.importorskip("fastsafetensors")
    rng = np.random.default_rng(6)
    paths = []
    for s in range(2):
        p = tmp_path / f"s{s}.safetensors"
        # gloo's scatter wants equal pieces: even rows.
        save_file({f"l{s}.w{t}": rng.standard_normal((4 + 2 * t, 3), np.float32) for t in range(2)},
                  str(p))  # fmt: skip
        paths.append(p)
    files = {0: [str(paths[0])], 1: [str(paths[1])]}
    for mode in ("tp", "replicate"):
        digests = expected_digests(paths, 2, mode)
        t, _ = ranks("fastsafetensors", ["cpu", "cpu"], mode, 1, digests, {"files": files})
        assert t > 0
    with pytest.raises(RuntimeError, match="rank"):
        bad = {0: [str(tmp_path / "missing.safetensors")], 1: [str(paths[1])]}
        ranks("fastsafetensors", ["cpu", "cpu"], "tp", 1, digests, {"files": bad})
