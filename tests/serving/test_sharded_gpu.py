"""Tensor-parallel slices into one GPU (``-m gpu``; one GPU is enough): each rank asking for
itself into ``cuda:0`` gets ``torch.chunk`` of what ``safetensors.torch.load_file`` loads, for
dim 0, dim 1 read both ways (strided segments in place, and one read cut on the device) and
uneven sizes; a replica list of one GPU is a plain read."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import put
from tiering.engine import Engine
from tiering.serving import Loader, LoaderConfig, LoadTarget
from tiering.serving.sharded import STRIDED_MIN_SEGMENT


def _gpus() -> int:
    try:
        return int(importlib.import_module("cupy").cuda.runtime.getDeviceCount())
    except Exception:
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU and cupy")]

MiB = 1 << 20
SPEC = {
    "world_size": 2,
    "rules": [{"pattern": "*.q.weight", "dim": 0}, {"pattern": "*.o.weight", "dim": 1}],
}
DIMS = {"l0.q.weight": 0, "l0.o.weight": 1, "l1.o.weight": 1}


@pytest.fixture
def loader(eng: Engine) -> Iterator[Loader]:
    ld = Loader(eng, LoaderConfig(gpu_budget_bytes=256 * MiB)).start()
    yield ld
    ld.stop()


@pytest.fixture
def ckpt(eng: Engine, tmp_path: Path) -> tuple[list[int], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    # uneven rows on dim 0; narrow columns (cut on the device) and wide ones (strided reads)
    wide = STRIDED_MIN_SEGMENT + 1
    parts = [
        {"l0.q.weight": torch.randn(1023, 64, generator=g), "l0.norm": torch.randn(64)},
        {"l0.o.weight": torch.randn(64, 333, generator=g), "l1.o.weight": torch.randn(3, wide)},
    ]
    ids, full = [], {}
    for i, part in enumerate(parts):
        p = tmp_path / f"s{i}.safetensors"
        save_file({k: v.to(torch.bfloat16) for k, v in part.items()}, str(p))
        ids.append(put(eng, f"tp/s{i}.safetensors", p.read_bytes()).id)
        full.update(load_file(str(p)))
    return ids, full


def _tensors(d: Any) -> dict[str, torch.Tensor]:
    cupy = importlib.import_module("cupy")
    bufs = {lease.id: cupy.asnumpy(lease.buffer.array()) for lease in d.loaded.leases}
    out = {}
    for name, t in d.loaded.tensors.items():
        raw = bufs[t.buffer_id][t.offset : t.offset + t.nbytes].view(np.uint16).copy()
        out[name] = torch.from_numpy(raw.reshape(t.shape)).view(torch.bfloat16)
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_into_one_gpu_equals_torch_chunk(loader: Loader, ckpt: Any, rank: int) -> None:
    ids, full = ckpt
    mine = LoadTarget.parse(devices=["cuda:0"], sharding=SPEC, rank=rank)
    [d] = loader.load_safetensors(ids, device=mine)
    assert (str(d.device), d.rank) == ("cuda:0", rank)
    got = _tensors(d)
    for name, tensor in full.items():
        want = tensor.chunk(2, DIMS[name])[rank] if name in DIMS else tensor
        assert torch.equal(got[name], want), name
    for lease in d.loaded.leases:
        loader.leases.release(lease.id)


def test_a_one_gpu_replica_list_is_a_plain_read(loader: Loader, ckpt: Any) -> None:
    ids, full = ckpt
    [d] = loader.load_safetensors(ids, device=LoadTarget.parse(devices=["cuda:0"]))
    got = _tensors(d)
    assert set(got) == set(full)
    for name, tensor in full.items():
        assert torch.equal(got[name], tensor), name
