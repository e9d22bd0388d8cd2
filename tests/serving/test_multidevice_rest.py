"""Multi-device and sharded loads over HTTP (a real server; CPU only): a rank's slices of a
torch-made bf16 checkpoint equal ``torch.chunk``, and every bad request is a 422 JSON error
that leaves nothing leased."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import LiveServer
from tests.serving.conftest import leased
from tierd_client import Client, InvalidRequest

SPEC = {
    "world_size": 2,
    "rules": [{"pattern": "*.q_proj.weight", "dim": 0}, {"pattern": "*.o_proj.weight", "dim": 1}],
}


@pytest.fixture
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture
def ckpt(upload: Callable[..., int], tmp_path: Path) -> tuple[list[int], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    parts = [
        {"l0.q_proj.weight": torch.randn(9, 4, generator=g), "l0.norm": torch.randn(4)},
        {"l0.o_proj.weight": torch.randn(4, 7, generator=g)},  # 7 over 2: 4 + 3
    ]
    ids, full = [], {}
    for i, part in enumerate(parts):
        p = tmp_path / f"m{i}.safetensors"
        save_file({k: v.to(torch.bfloat16) for k, v in part.items()}, str(p))
        ids.append(upload(f"tp/m{i}.safetensors", p.read_bytes()))
        full.update(load_file(str(p)))
    return ids, full


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_over_http_equals_torch_chunk(api: Client, ckpt: Any, rank: int) -> None:
    ids, full = ckpt
    [t] = api.load_safetensors(ids, sharding=SPEC, rank=rank)
    assert (t.device, t.rank, t.delivery) == ("cpu", rank, "read")
    got = t.torch()
    dims = {"l0.q_proj.weight": 0, "l0.o_proj.weight": 1}
    for name, tensor in full.items():
        want = tensor.chunk(2, dims[name])[rank] if name in dims else tensor
        assert torch.equal(got[name], want), name
    assert t.full_shapes["l0.o_proj.weight"] == (4, 7)
    assert t.slice_offsets["l0.o_proj.weight"] == (0, 4 * rank)
    assert t.slice_offsets["l0.norm"] == (0,)
    t.close()
    assert leased(api) == 0


def test_device_lists_of_one_and_the_unchanged_single_device_reply(
    api: Client, http: httpx.Client, upload: Callable[..., int]
) -> None:
    data = np.arange(64, dtype=np.float32)
    fid = upload("v/m.bin", data.tobytes())
    single = http.post("/v1/load", json={"file_id": fid, "device": "cpu"}).json()
    assert "buffers" not in single and single["nbytes"] == 256
    api.release(single["buffer_id"])
    many = http.post("/v1/load", json={"file_id": fid, "devices": ["cpu"]}).json()
    [buf] = many["buffers"]
    assert (buf["device"], buf["delivery"], buf["nbytes"]) == ("cpu", "read", 256)
    api.release(buf["buffer_id"])
    body = {"file_id": fid, "dim": 8, "start": 2, "count": 3, "devices": ["cpu"]}
    [rows] = http.post("/v1/vectors/gather", json=body).json()["buffers"]
    assert rows["shape"] == [3, 8]
    api.release(rows["buffer_id"])
    assert leased(api) == 0
    # Per-device figures: three loads of 256 + 256 + 96 bytes into cpu, in stats and /metrics.
    cpu = http.get("/v1/stats").json()["by_device"]["cpu"]
    assert (cpu["bytes"], cpu["ops"]) == (608, 3) and cpu["gbps"] >= 0
    text = http.get("/metrics").text
    assert 'tierd_load_seconds_by_device_total{device="cpu"}' in text


def _bad_safetensors(ids: list[int]) -> list[tuple[dict[str, Any], str]]:
    base = {"file_ids": ids}
    return [
        ({**base, "devices": ["cpu", "cpu"]}, "invalid_device"),
        ({**base, "devices": ["cpu", "cuda:0"]}, "invalid_device"),
        ({**base, "devices": ["cuda:*"]}, "invalid_device"),
        ({**base, "devices": ["npu:3"]}, "invalid_device"),
        ({**base, "device": "cpu", "devices": ["cpu"]}, "invalid_request"),
        ({**base, "sharding": SPEC}, "invalid_sharding"),  # every rank needs 2 devices
        ({**base, "sharding": SPEC, "rank": 2}, "invalid_sharding"),
        ({**base, "rank": 0}, "invalid_sharding"),
        ({**base, "sharding": {**SPEC, "world_size": 0}, "rank": 0}, "invalid_request"),
        ({**base, "sharding": {**SPEC, "world_size": 8}, "rank": 0}, "invalid_sharding"),
        (
            {**base, "sharding": {"world_size": 2, "rules": [{"pattern": "*norm", "dim": 1}]}},
            "invalid_sharding",
        ),
        (
            {
                **base,
                "sharding": {
                    **SPEC,
                    "rules": [{"pattern": "*.k_proj.*", "dim": 0}],
                    "strict": True,
                },
                "rank": 0,
            },
            "invalid_sharding",
        ),
        ({**base, "sharding": SPEC, "rank": 0, "shared": True}, "invalid_request"),
    ]


def test_every_bad_request_is_a_422_and_leases_nothing(
    api: Client, http: httpx.Client, ckpt: Any, upload: Callable[..., int]
) -> None:
    ids, _ = ckpt
    fid = upload("v/x.bin", bytes(64))
    cases = _bad_safetensors(ids) + [
        ({"file_id": fid, "devices": ["cpu", "cpu"]}, "invalid_device"),
        ({"file_id": fid, "devices": []}, "invalid_request"),
        ({"file_id": fid, "devices": ["cuda:*"], "shared": True}, "invalid_request"),
    ]
    for body, code in cases:
        route = "/v1/load/safetensors" if "file_ids" in body else "/v1/load"
        r = http.post(route, json=body)
        assert r.status_code == 422, (body, r.text)
        err = r.json()["error"]
        assert err["code"] == code and err["message"], (body, err)
        assert leased(api) == 0
    g = {"file_id": fid, "dim": 4, "start": 0, "count": 2, "devices": ["cpu", "cpu"]}
    r = http.post("/v1/vectors/gather", json=g)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_device"
    # The messages name the problem.
    strict = _bad_safetensors(ids)[11][0]
    assert "*.k_proj.*" in http.post("/v1/load/safetensors", json=strict).json()["error"]["message"]
    with pytest.raises(InvalidRequest, match="larger than dimension"):
        api.load_safetensors(ids, sharding={**SPEC, "world_size": 8}, rank=0)
    assert leased(api) == 0


def test_devices_may_be_a_string_as_the_readme_spells_cuda_all(
    api: Client, http: httpx.Client, ckpt: Any, upload: Callable[..., int]
) -> None:
    # Issue 27: "devices": "cuda:*" was refused as not a list (invalid_request). It names every
    # GPU now; this host has none, which is what the 422 says. A string names one device.
    ids, _ = ckpt
    fid = upload("v/s.bin", bytes(range(64)))
    for route, body in [
        ("/v1/load", {"file_id": fid}),
        ("/v1/load/safetensors", {"file_ids": ids}),
        ("/v1/vectors/gather", {"file_id": fid, "dim": 8, "start": 0, "count": 2}),
    ]:
        r = http.post(route, json={**body, "devices": "cuda:*"})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_device" and "no GPU" in err["message"], (route, err)
        one = http.post(route, json={**body, "devices": "cpu"})
        assert one.status_code == 200, (route, one.text)
        entries = one.json().get("devices") or one.json()["buffers"]
        assert len(entries) == 1 and entries[0]["device"] == "cpu", route
        buffers = entries[0].get("buffers", entries)
        for b in buffers:
            api.release(b["buffer_id"])
    assert leased(api) == 0
    with pytest.raises(InvalidRequest, match="no GPU"):
        api.load(fid, devices="cuda:*")
    [b] = api.load(fid, devices="cpu", length=16)
    assert (b.device, b.info["delivery"], b.nbytes) == ("cpu", "read", 16)
    b.close()
    # The client parses a target as the server does: what it would refuse fails the same way.
    with pytest.raises(InvalidRequest) as info:
        api.gather(fid, dim=8, start=0, count=2, devices=["cpu", "cpu"])
    assert (info.value.status, info.value.code) == (422, "invalid_device")
    assert leased(api) == 0


@pytest.mark.parametrize("rank", [0, 1])
def test_models_load_takes_devices_sharding_and_rank(
    api: Client, http: httpx.Client, ckpt: Any, rank: int
) -> None:
    # Issue 27: /v1/models/load takes the body of /v1/load/safetensors, devices and sharding
    # included (they were unknown fields: invalid_request). "tp" holds the checkpoint's shards.
    _, full = ckpt
    url = "/v1/models/load?name=tp"
    r = http.post(url, json={"sharding": SPEC, "rank": rank})
    assert r.status_code == 200, r.text
    [entry] = r.json()["devices"]
    assert (entry["device"], entry["rank"], entry["delivery"]) == ("cpu", rank, "read")
    assert entry["tensors"]["l0.o_proj.weight"]["full_shape"] == [4, 7]
    for b in entry["buffers"]:
        api.release(b["buffer_id"])
    r = http.post(url, json={"devices": ["cpu"]})
    assert r.status_code == 200, r.text
    [entry] = r.json()["devices"]
    assert entry["rank"] is None and set(entry["tensors"]) == set(full)
    for b in entry["buffers"]:
        api.release(b["buffer_id"])
    for body, code in [
        ({"sharding": SPEC}, "invalid_sharding"),  # every rank needs 2 devices
        ({"devices": "cuda:*"}, "invalid_device"),
        ({"devices": ["cpu"], "shared": True}, "invalid_request"),
        ({"device": "cpu", "devices": ["cpu"]}, "invalid_request"),
    ]:
        r = http.post(url, json=body)
        assert r.status_code == 422 and r.json()["error"]["code"] == code, (body, r.text)
    assert leased(api) == 0
    # The client: the same target, one Tensors per device.
    [t] = api.load_model("tp", sharding=SPEC, rank=rank)
    dims = {"l0.q_proj.weight": 0, "l0.o_proj.weight": 1}
    got = t.torch()
    for name, tensor in full.items():
        want = tensor.chunk(2, dims[name])[rank] if name in dims else tensor
        assert torch.equal(got[name], want), name
    t.close()
    assert leased(api) == 0
