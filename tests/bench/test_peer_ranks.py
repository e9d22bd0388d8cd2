"""The one-process-per-rank loads of ``tierd bench models`` on ``cpu`` (gloo joins the ranks):
tierd over REST from a real server, and fastsafetensors where it is installed. Each rank's
bytes are checked against checksums computed from the files, and a wrong expectation is
caught, so the check can fail."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("torch")

from safetensors.numpy import save_file  # noqa: E402

from tierd_bench._peerranks import expected_digests, ranks  # noqa: E402
from tierd_bench.rest import server_process  # noqa: E402
from tiering.checksum import Hasher  # noqa: E402


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


def test_tierd_ranks_over_rest_checked(tmp_path: Path) -> None:
    paths = _shards(tmp_path)
    rel = [f"m/{p.name}" for p in paths]
    with server_process(tmp_path) as (url, _):
        digests = expected_digests(paths, 2, "tp")
        t, sources = ranks("tierd", ["cpu", "cpu"], "tp", 1, digests, {"url": url, "paths": rel})
        assert t > 0 and sources == {"page_cache"}
        wrong = expected_digests(paths, 2, "replicate")
        with pytest.raises(AssertionError, match="differ"):
            ranks("tierd", ["cpu", "cpu"], "tp", 1, wrong, {"url": url, "paths": rel})
    with pytest.raises(ValueError):
        ranks("tierd", ["cpu"], "tp", 1, digests[:1], {"url": url, "paths": rel})


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
