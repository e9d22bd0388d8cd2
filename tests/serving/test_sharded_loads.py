"""Multi-device and sharded loads of the library, in-process on a real engine, on ``cpu``.

A CPU host has one device, so what runs here is every refusal (each leaves nothing leased)
and the one-device paths: a rank of a tensor-parallel split into ``cpu`` (both ways of
reading a split along dim 1), every rank of a ``world_size`` 1 split, and replicas to a
one-device list. The several-GPU paths are in ``test_multigpu.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import put
from tiering.engine import Engine
from tiering.errors import InsufficientSpace, InvalidDevice, InvalidInput, InvalidSharding
from tiering.serving import Loader, LoaderConfig, LoadTarget
from tiering.serving.sharded import STRIDED_MIN_SEGMENT, DeviceLoaded

MiB = 1 << 20
# Columns of "wide": split on dim 1 in two, its bf16 row segments are STRIDED_MIN_SEGMENT
# bytes (read in place); those of "l0.o.weight" are a few bytes (one read, cut on the device).
WIDE = STRIDED_MIN_SEGMENT
SPEC = {
    "world_size": 2,
    "rules": [
        {"pattern": "*.q.weight", "dim": 0},
        {"pattern": "*.o.weight", "dim": 1},
        {"pattern": "wide", "dim": 1},
    ],
}


@pytest.fixture
def loader(eng: Engine) -> Iterator[Loader]:
    ld = Loader(eng, LoaderConfig(cpu_budget_bytes=16 * MiB)).start()
    yield ld
    ld.stop()


@pytest.fixture
def shards(eng: Engine, tmp_path: Path) -> tuple[list[int], dict[str, torch.Tensor]]:
    """A two-shard bf16 checkpoint made with torch; its tensors as safetensors loads them."""
    g = torch.Generator().manual_seed(0)
    parts = [
        {
            "l0.q.weight": torch.randn(7, 6, generator=g),  # uneven over 2: 4 + 3 rows
            "l0.o.weight": torch.randn(6, 5, generator=g),  # uneven on dim 1: 3 + 2
            "l0.norm": torch.randn(6, generator=g),  # no rule: replicated
        },
        {"wide": torch.randn(3, WIDE, generator=g), "l1.q.weight": torch.randn(2, 3)},
    ]
    ids, full = [], {}
    for i, part in enumerate(parts):
        p = tmp_path / f"s{i}.safetensors"
        save_file({k: v.to(torch.bfloat16) for k, v in part.items()}, str(p))
        ids.append(put(eng, f"m/s{i}.safetensors", p.read_bytes()).id)
        full.update(load_file(str(p)))
    return ids, full


def _tensors(d: DeviceLoaded) -> dict[str, torch.Tensor]:
    bufs = {lease.id: lease.buffer.array() for lease in d.loaded.leases}
    out = {}
    for name, t in d.loaded.tensors.items():
        raw = np.asarray(bufs[t.buffer_id][t.offset : t.offset + t.nbytes]).view(np.uint16)
        out[name] = torch.from_numpy(raw.copy().reshape(t.shape)).view(torch.bfloat16)
    return out


def _leased(ld: Loader) -> int:
    return sum(ld.leases.leased_bytes().values())


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_into_cpu_equals_torch_chunk(loader: Loader, shards: Any, rank: int) -> None:
    ids, full = shards
    to = LoadTarget.parse(devices=["cpu"], sharding=SPEC, rank=rank)
    [d] = loader.load_safetensors(ids, device=to)
    assert (str(d.device), d.rank, d.delivery) == ("cpu", rank, "read")
    got = _tensors(d)
    dims = {"l0.q.weight": 0, "l1.q.weight": 0, "l0.o.weight": 1, "wide": 1}
    for name, tensor in full.items():
        if name in dims:
            want = tensor.chunk(2, dims[name])[rank]
            loc = d.loaded.tensors[name]
            assert loc.full_shape == tuple(tensor.shape)
            offset = [0] * tensor.dim()
            offset[dims[name]] = rank * -(-tensor.shape[dims[name]] // 2)
            assert loc.slice_offset == tuple(offset)
        else:
            want = tensor
        assert torch.equal(got[name], want), name
    # Only the slices were leased: every rank holds about half of the split bytes.
    assert sum(t.nbytes for t in d.loaded.tensors.values()) < sum(
        t.numel() * 2 for t in full.values()
    )
    for lease in d.loaded.leases:
        loader.leases.release(lease.id)
    assert _leased(loader) == 0


def test_every_rank_of_a_one_rank_split_and_replicas_on_one_device(
    loader: Loader, shards: Any
) -> None:
    ids, full = shards
    one = {"world_size": 1, "rules": [{"pattern": "*", "dim": 0}]}
    [d] = loader.load_safetensors(ids, device=LoadTarget.parse(devices="cpu", sharding=one))
    assert d.rank == 0 and all(torch.equal(_tensors(d)[n], t) for n, t in full.items())
    cpu = LoadTarget.parse(devices=["cpu"])
    [r] = loader.load_safetensors(ids, device=cpu)
    assert r.rank is None and set(_tensors(r)) == set(full)
    (rep,) = loader.load(ids[0], device=cpu, length=64)
    assert rep.delivery == "read" and rep.lease.nbytes == 64
    (rows,) = loader.gather(ids[0], device=cpu, dim=1, dtype="uint8", start=0, count=8)
    assert rows.delivery == "read" and rows.lease.shape == (8, 1)


BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"devices": ["cpu", "cpu"]}, InvalidDevice, "cpu cannot be one of several"),
    ({"devices": ["cpu", "cuda:0"]}, InvalidDevice, "cpu cannot be one of several"),
    ({"devices": ["cuda:0", "cuda:0"]}, InvalidDevice, "named twice"),
    ({"devices": ["cuda:*", "cuda:0"]}, InvalidDevice, "give it alone"),
    ({"devices": ["cuda:0"]}, InvalidDevice, "no CUDA"),
    ({"devices": ["cuda:*"]}, InvalidDevice, "no GPU"),
    ({"devices": ["tpu:0"]}, InvalidDevice, "tpu"),
    ({"devices": []}, InvalidDevice, "at least one"),
    ({"devices": ["cpu"], "rank": 0}, InvalidSharding, "rank needs a sharding spec"),
    ({"devices": ["cpu"], "sharding": SPEC}, InvalidSharding, "one device per rank"),
    ({"devices": ["cpu"], "sharding": SPEC, "rank": 2}, InvalidSharding, "rank must be in"),
    ({"sharding": {**SPEC, "world_size": 0}, "rank": 0}, InvalidSharding, "world_size"),
    ({"sharding": {**SPEC, "world_size": 3}, "rank": 0}, InvalidSharding, "larger than"),
    (
        {"sharding": {"world_size": 2, "rules": [{"pattern": "*norm", "dim": 1}]}, "rank": 0},
        InvalidSharding,
        "has no dimension 1",
    ),
    (
        {"sharding": {**SPEC, "rules": [{"pattern": "x*", "dim": 0}], "strict": True}, "rank": 1},
        InvalidSharding,
        "match no tensor",
    ),
    ({"sharding": SPEC, "rank": 0, "shared": True}, InvalidInput, "shared"),
]


@pytest.mark.parametrize(("kw", "error", "words"), BAD)
def test_bad_requests_are_refused_leasing_nothing(
    loader: Loader, shards: Any, kw: dict[str, Any], error: type[Exception], words: str
) -> None:
    ids, _ = shards
    where = {k: v for k, v in kw.items() if k != "shared"}
    with pytest.raises(error, match=words):
        loader.load_safetensors(ids, device=LoadTarget.parse(**where), shared="shared" in kw)
    assert _leased(loader) == 0


def test_replica_refusals_and_budget_overrun_lease_nothing(eng: Engine, shards: Any) -> None:
    ids, _ = shards
    ld = Loader(eng, LoaderConfig(cpu_budget_bytes=64 << 10)).start()
    try:
        rank0 = LoadTarget.parse(devices=["cpu"], sharding=SPEC, rank=0)
        with pytest.raises(InsufficientSpace):
            ld.load_safetensors(ids, device=rank0)
        with pytest.raises(InvalidDevice):
            LoadTarget.parse(devices=["cpu", "cpu"])
        every = LoadTarget.parse(devices="cuda:*")
        with pytest.raises(InvalidDevice, match="no GPU"):
            ld.load(ids[0], device=every)
        with pytest.raises(InvalidDevice, match="no GPU"):
            ld.gather(ids[0], device=every, dim=1, dtype="uint8", start=0, count=8)
        # A sharding splits tensors: a range or rows load refuses one.
        tp = LoadTarget.parse(devices=["cpu"], sharding={"world_size": 1})
        with pytest.raises(InvalidSharding, match="safetensors"):
            ld.load(ids[0], device=tp)
        assert _leased(ld) == 0
    finally:
        ld.stop()
