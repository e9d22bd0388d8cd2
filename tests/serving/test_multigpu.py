"""Multi-GPU loads on a host with at least two GPUs (``-m gpu``; skipped below two).

Replicated loads are byte-identical on every device; tensor-parallel slices of a torch-made
bf16 checkpoint equal ``torch.chunk`` of what ``safetensors.torch.load_file`` loads, for dim 0,
dim 1 and uneven sizes, for one request of every rank and for each rank asking for itself; a
second process opens every device's lease through the client.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import LiveServer, make_settings
from tests.helpers import put
from tiering.engine import Engine
from tiering.errors import InsufficientSpace, InvalidDevice
from tiering.io import GpuDirectStorage, fanout
from tiering.io._device import parse_device
from tiering.serving import Loader, LoaderConfig, LoadTarget

MiB = 1 << 20


def _gpus() -> int:
    try:
        return int(importlib.import_module("cupy").cuda.runtime.getDeviceCount())
    except Exception:
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpus() < 2, reason="multi-GPU loads need at least 2 GPUs"),
]

SPEC = {
    "world_size": 2,
    "rules": [{"pattern": "*.q.weight", "dim": 0}, {"pattern": "*.o.weight", "dim": 1}],
}
DIMS = {"l0.q.weight": 0, "l0.o.weight": 1, "l1.q.weight": 0, "l1.o.weight": 1}
TP = LoadTarget.parse(devices=["cuda:0", "cuda:1"], sharding=SPEC)


@pytest.fixture
def loader(eng: Engine) -> Iterator[Loader]:
    ld = Loader(eng, LoaderConfig(gpu_budget_bytes=256 * MiB)).start()
    yield ld
    ld.stop()


@pytest.fixture
def ckpt(eng: Engine, tmp_path: Path) -> tuple[list[int], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    parts = [
        {"l0.q.weight": torch.randn(1023, 64, generator=g), "l0.norm": torch.randn(64)},
        # o: a small one (cut on the device) and a wide one (strided reads), both uneven.
        {"l0.o.weight": torch.randn(64, 333, generator=g)},
        {"l1.o.weight": torch.randn(3, 262_145, generator=g), "l1.q.weight": torch.randn(5, 7)},
    ]
    ids, full = [], {}
    for i, part in enumerate(parts):
        p = tmp_path / f"s{i}.safetensors"
        save_file({k: v.to(torch.bfloat16) for k, v in part.items()}, str(p))
        ids.append(put(eng, f"tp/s{i}.safetensors", p.read_bytes()).id)
        full.update(load_file(str(p)))
    return ids, full


def _host(arr: Any) -> np.ndarray:
    out: np.ndarray = importlib.import_module("cupy").asnumpy(arr)
    return out


def _tensors(d: Any) -> dict[str, torch.Tensor]:
    bufs = {lease.id: _host(lease.buffer.array()) for lease in d.loaded.leases}
    out = {}
    for name, t in d.loaded.tensors.items():
        raw = bufs[t.buffer_id][t.offset : t.offset + t.nbytes].view(np.uint16).copy()
        out[name] = torch.from_numpy(raw.reshape(t.shape)).view(torch.bfloat16)
    return out


@pytest.mark.parametrize("mode", ["auto", "peer", "host"])
def test_replicated_loads_are_byte_identical_on_every_device(eng: Engine, mode: str) -> None:
    ld = Loader(eng, LoaderConfig(gpu_budget_bytes=256 * MiB, gpu_delivery=mode)).start()
    try:
        _replicas_of_every_size(eng, ld, mode)
    finally:
        ld.stop()


def _replicas_of_every_size(eng: Engine, ld: Loader, mode: str) -> None:
    n = _gpus()
    data = os.urandom(8 * MiB + 123)
    rec = put(eng, f"r/{mode}.bin", data)
    # Whole, a range off every boundary of the split (2 MiB parts), one too small to split.
    every = LoadTarget.parse(devices="cuda:*")
    for offset, length in [(0, None), (4097, 5 * MiB + 7), (11, 100)]:
        reps = ld.load(rec.id, device=every, offset=offset, length=length)
        assert [str(r.lease.device) for r in reps] == [f"cuda:{i}" for i in range(n)]
        # NVLink hosts split: peer copies measure far faster than the host's links.
        if fanout.choose([r.lease.device for r in reps], mode) == "peer":
            assert {r.delivery for r in reps} == {"split"}
        else:
            assert [r.delivery for r in reps] == ["read"] + ["host"] * (n - 1)
        want = data[offset : None if length is None else offset + length]
        for r in reps:
            assert _host(r.lease.buffer.array()[: r.lease.nbytes]).tobytes() == want
        ld.leases.release_many([r.lease.id for r in reps])
    # A gather reads rows of a matrix: a file of whole rows of 16 float32.
    matrix = put(eng, f"r/rows-{mode}.bin", data[: 8 * MiB])
    back = LoadTarget.parse(devices=["cuda:1", "cuda:0"])
    rows = ld.gather(matrix.id, device=back, dim=16, start=3, count=9)
    assert rows[0].delivery == "read" and rows[1].delivery in {"peer", "host"}
    # Bytes, not floats: random bytes hold NaNs, and NaN != NaN.
    want_rows = data[: 8 * MiB][3 * 64 : 12 * 64]
    for r in rows:
        assert _host(r.lease.buffer.array()[: r.lease.nbytes]).tobytes() == want_rows
    ld.leases.release_many([r.lease.id for r in rows])
    assert sum(ld.leases.leased_bytes().values()) == 0


def test_the_choice_is_measured_once_per_pair() -> None:
    cuda = [parse_device(f"cuda:{i}") for i in range(2)]
    fanout.choose(cuda, "auto")
    rates = fanout.measured()
    if not all(fanout.peer_ok(a, [b]) for a in cuda for b in cuda if a != b):
        pytest.skip("these GPUs have no peer access: nothing to measure")
    assert {"cuda:0->cuda:1", "cuda:1->cuda:0"} <= set(rates)
    assert all(r["peer_gbps"] > 0 and r["host_gbps"] > 0 for r in rates.values())
    fanout.choose(cuda, "auto")
    assert fanout.measured() == rates  # cached, not measured again


@pytest.mark.parametrize("mode", ["auto", "host"])
def test_replicated_safetensors_and_every_rank_in_one_request(
    eng: Engine, ckpt: Any, mode: str, tmp_path: Path
) -> None:
    ids, full = ckpt
    # A shard over several parts of a split (2 MiB), tensors crossing their boundaries.
    g = torch.Generator().manual_seed(5)
    big = {f"big.{i}": torch.randn(1000 + i, 777, generator=g).to(torch.bfloat16) for i in range(4)}
    p = tmp_path / "big.safetensors"
    save_file(big, str(p))
    ids = [*ids, put(eng, "tp/big.safetensors", p.read_bytes()).id]
    full = {**full, **big}
    ld = Loader(eng, LoaderConfig(gpu_budget_bytes=256 * MiB, gpu_delivery=mode)).start()
    try:
        reps = ld.load_safetensors(ids, device=LoadTarget.parse(devices=["cuda:0", "cuda:1"]))
        split = fanout.choose([d.device for d in reps], mode) == "peer"
        assert [d.delivery for d in reps] == (["split"] * 2 if split else ["read", "host"])
        for d in reps:
            got = _tensors(d)
            assert all(torch.equal(got[n], t) for n, t in full.items())
        ld.leases.release_many([lease.id for d in reps for lease in d.loaded.leases])
        ranks = ld.load_safetensors(ids, device=TP)
        for k, d in enumerate(ranks):
            assert (d.rank, str(d.device), d.delivery) == (k, f"cuda:{k}", "read")
            got = _tensors(d)
            for name, tensor in full.items():
                want = tensor.chunk(2, DIMS[name])[k] if name in DIMS else tensor
                assert torch.equal(got[name], want), (k, name)
    finally:
        ld.stop()


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_asking_for_itself(loader: Loader, ckpt: Any, rank: int) -> None:
    ids, full = ckpt
    mine = LoadTarget.parse(devices=[f"cuda:{rank}"], sharding=SPEC, rank=rank)
    [d] = loader.load_safetensors(ids, device=mine)
    got = _tensors(d)
    for name, tensor in full.items():
        want = tensor.chunk(2, DIMS[name])[rank] if name in DIMS else tensor
        assert torch.equal(got[name], want), name


def test_budget_overrun_on_one_device_leaves_nothing_on_the_others(eng: Engine) -> None:
    rec = put(eng, "r/big.bin", os.urandom(6 * MiB))
    ld = Loader(eng, LoaderConfig(gpu_budget_bytes=4 * MiB)).start()
    try:
        with pytest.raises(InsufficientSpace):
            ld.load(rec.id, device=LoadTarget.parse(devices=["cuda:0", "cuda:1"]))
        assert sum(ld.leases.leased_bytes().values()) == 0
    finally:
        ld.stop()


CHILD = """
import json, sys
import cupy as cp
from tierd_client import Client
args = json.loads(sys.argv[1])
with Client(args["url"]) as c:
    out = []
    for entry in args["buffers"]:
        with c.open_buffer(entry["buffer_id"]) as b:
            assert b.device == entry["device"], (b.device, entry["device"])
            out.append(cp.asnumpy(b.array).view("uint8").tobytes().hex()[:64])
print(json.dumps(out))
"""


def test_a_second_process_opens_every_devices_lease(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "srv", watch=False)
    data = os.urandom(2 * MiB)
    with LiveServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        r = http.put("/v1/files/content", params={"path": "x.bin"}, content=data)
        fid = r.json()["id"]
        # "cuda:*" as the README spells it: a string, not a list.
        reply = http.post("/v1/load", json={"file_id": fid, "devices": "cuda:*"}).json()
        assert len(reply["buffers"]) == _gpus()
        args = {"url": srv.url, "buffers": reply["buffers"]}
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        done = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == [data.hex()[:64]] * _gpus()


def test_loads_leave_the_callers_current_device_alone(
    eng: Engine, loader: Loader, ckpt: Any
) -> None:
    cp = importlib.import_module("cupy")
    rec = put(eng, "r/current.bin", os.urandom(3 * MiB))
    ids, _ = ckpt
    for before in (0, 1):
        cp.cuda.runtime.setDevice(before)
        for d in ("cuda:1", "cuda:0", "cuda:1"):
            loader.leases.release(loader.load(rec.id, device=d).id)
            assert cp.cuda.runtime.getDevice() == before
        out = loader.load_safetensors(ids, device=TP)
        loader.leases.release_many([lease.id for d in out for lease in d.loaded.leases])
        assert cp.cuda.runtime.getDevice() == before
    cp.cuda.runtime.setDevice(0)


def test_one_thread_switches_between_devices() -> None:
    cp = importlib.import_module("cupy")
    for order in ((1, 0, 1), (0, 1, 0, 1)):
        for i in order:
            parse_device(f"cuda:{i}").make_current()
            assert cp.cuda.runtime.getDevice() == i
    cp.cuda.runtime.setDevice(0)


def test_a_buffer_on_another_gpu_is_refused_whatever_is_current(tmp_path: Path) -> None:
    cp = importlib.import_module("cupy")
    (tmp_path / "f.bin").write_bytes(os.urandom(1 << 16))
    with cp.cuda.Device(1):
        other = cp.empty((64, 1024), dtype=cp.uint8)[:, :512]  # not the fast path's flat array
    with GpuDirectStorage("cuda:0") as gds, gds.open_file(tmp_path / "f.bin") as f:
        for current in (0, 1):
            with cp.cuda.Device(current), pytest.raises(InvalidDevice, match="cuda:1"):
                gds.load_to_gpu(f, 0, other)
