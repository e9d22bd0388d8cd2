"""``tierd_bench._ranks``: one request for every rank against one worker process per rank,
through a real tierd server. The measure needs two GPUs; its import and its refusals don't."""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tierd_bench._ranks import per_rank_processes


def _gpus() -> int:
    try:
        return int(importlib.import_module("cupy").cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def test_imports_without_cuda() -> None:
    # Worker processes and the bench's command line import the module; neither may pay for
    # (or need) torch or CUDA until a measure runs.
    code = (
        "import sys, tierd_bench._ranks; "
        "bad = {'torch', 'cupy', 'kvikio'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_refuses_a_device_per_rank_mismatch(tmp_path: Path) -> None:
    spec = {"world_size": 2, "rules": [{"pattern": "*", "dim": 0}]}
    with pytest.raises(ValueError, match="one per rank"):
        per_rank_processes([tmp_path / "x.safetensors"], spec, ["cuda:0"], 1, lambda s: None)
    with pytest.raises(ValueError, match="repeats"):
        per_rank_processes([], spec, ["cuda:0", "cuda:1"], 0, lambda s: None)


def _checkpoint(root: Path, shapes: dict[str, tuple[int, ...]], shards: int) -> list[Path]:
    """``shards`` bf16 safetensors files, each holding every shape under its own names."""
    torch = pytest.importorskip("torch")
    save_file = pytest.importorskip("safetensors.torch").save_file
    files = []
    for i in range(shards):
        path = root / f"model-{i}.safetensors"
        tensors = {f"layers.{i}.{k}": torch.randn(s).to(torch.bfloat16) for k, s in shapes.items()}
        save_file(tensors, str(path))
        files.append(path)
    return files


@pytest.mark.slow  # suite time: ~8 CPU-seconds of gloo ranks (the 2-GPU run is the real one)
def test_the_whole_protocol_on_cpu(tmp_path: Path) -> None:
    # One rank in host memory: the server, the hard links, the workers, their checks and the
    # cleanup all run for real, without a GPU.
    files = _checkpoint(tmp_path, {"row": (5, 24), "bias": (11,)}, 2)
    spec = {"world_size": 1, "rules": [{"pattern": "*.row", "dim": 0}]}
    said: list[str] = []
    one, per_rank = per_rank_processes(files, spec, ["cpu"], 1, said.append)  # 1: the path
    for t in (one, per_rank):
        assert t > 0 and math.isfinite(t)
    assert all(f.stat().st_nlink == 1 for f in files)  # the links went with the temp dir
    assert not [s for s in said if "copied" in s]  # same filesystem: linked, not copied


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
def test_one_request_and_per_rank_processes(tmp_path: Path) -> None:
    # Odd sizes: uneven chunks (5 rows over 2 ranks: 3 and 2), a split along dim 1, and a
    # tensor no rule matches (replicated), so the workers' checks see every case.
    files = _checkpoint(tmp_path, {"row": (5, 24), "col": (3, 7), "bias": (11,)}, 2)
    spec = {
        "world_size": 2,
        "rules": [{"pattern": "*.row", "dim": 0}, {"pattern": "*.col", "dim": 1}],
    }
    said: list[str] = []
    one, per_rank = per_rank_processes(files, spec, ["cuda:0", "cuda:1"], 1, said.append)
    for t in (one, per_rank):
        assert t > 0 and math.isfinite(t)
    assert said  # the bench told what it was doing
