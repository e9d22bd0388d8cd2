"""A kept GPU copy serves every load of its file (issue 39, point 3), on a GPU.

A shared model load, its leases then let go (a serving process that exited): the copies of the
shards' tensors stay on the GPU. Every other load of the shards then copies from them (source
``gpu``, I/O path ``copy``): a whole file (its header from the copy's head), a range, tensors
all or some, a plain model load, a load into ``cpu``; a shared load of a selection is handed
the kept allocation. The CPU rules are in ``test_kept_copies.py``.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.serving.test_residency_gpu import _child, _load
from tests.serving.test_residency_gpu import http as http  # noqa: F401 (fixtures)
from tests.serving.test_residency_gpu import srv as srv  # noqa: F401
from tierd_client import Client

pytestmark = pytest.mark.gpu

MODEL = "/v1/models/load?name=models/g"


def _shards(
    http: httpx.Client, tmp_path: Path
) -> tuple[dict[str, np.ndarray], list[Path], list[int]]:
    rng = np.random.default_rng(5)
    tensors = {
        "embed.weight": rng.standard_normal((512, 256)).astype(np.float32),
        "layer.0.bias": np.arange(1000, dtype=np.int64),
        "lm_head.weight": rng.standard_normal((256, 300)).astype(np.float32),
    }
    paths, ids = [], []
    for i, names in enumerate((["embed.weight", "layer.0.bias"], ["lm_head.weight"])):
        p = tmp_path / f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in names}, str(p))
        r = http.put(
            "/v1/files/content", params={"path": f"models/g/{p.name}"}, content=p.read_bytes()
        )
        assert r.status_code == 201, r.text
        paths.append(p)
        ids.append(int(r.json()["id"]))
    return tensors, paths, ids


def _allocated(http: httpx.Client) -> int:
    """Bytes of GPU allocations the service holds for loads: leased ones and kept copies."""
    b = http.get("/v1/buffers").json()
    return sum(b["leased_bytes"].values()) + sum(b["kept_bytes"].values())


def _page_cache(http: httpx.Client) -> int:
    by = http.get("/v1/stats").json()["by_source"]
    return int(by.get("page_cache", {}).get("bytes_transferred", 0))


def _post(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_load_of_a_kept_model_copies_on_the_gpu(srv, http, tmp_path):
    tensors, paths, ids = _shards(http, tmp_path)
    first = _post(http, MODEL, {"device": "cuda:0", "shared": True})
    assert all(b["source"] == "page_cache" for b in first["buffers"])
    for b in first["buffers"]:  # the process that loaded it is gone; its copies stay
        assert http.delete(f"/v1/buffers/{b['buffer_id']}").status_code == 200
    kept = sum(http.get("/v1/buffers").json()["resident_bytes"].values())
    assert kept > 0
    read = _page_cache(http)

    loads = [
        _post(http, MODEL, {"device": "cuda:0"})["buffers"],
        _post(http, "/v1/load/safetensors", {"file_ids": ids, "device": "cuda:0"})["buffers"],
        _post(
            http,
            "/v1/load/safetensors",
            {"file_ids": ids, "device": "cuda:0", "names": ["lm_head.weight"]},
        )["buffers"],
        [_load(http, ids[0], "cuda:0")],
        [
            _post(
                http,
                "/v1/load",
                {"file_id": ids[1], "device": "cuda:0", "offset": 8, "length": 4096},
            )
        ],
        [_load(http, ids[0], "cpu")],
    ]
    for bufs in loads:
        for b in bufs:
            assert b["source"] == "gpu" and b["io_path"] == "copy", b
            assert not b["read_only"]
    # The whole file copied into a GPU buffer of its own: header from the head, tensors D2D.
    whole = loads[3][0]["buffer_id"]
    seen = _child(srv, paths[0], [whole])
    assert seen[whole]["same"], seen
    with Client(srv.url) as api, api.load(ids[0], device="cpu") as host:
        assert np.asarray(host).tobytes() == paths[0].read_bytes()
        assert host.source == "gpu"
    # A shared selection is handed the kept allocation: no new bytes (kept becomes leased).
    before = _allocated(http)
    sel = _post(
        http,
        "/v1/load/safetensors",
        {"file_ids": ids, "device": "cuda:0", "shared": True, "names": ["layer.0.bias"]},
    )
    (b,) = sel["buffers"]
    assert b["reused"] and b["source"] == "gpu"
    assert _allocated(http) == before
    assert _page_cache(http) == read  # not one byte more from the files
    with Client(srv.url) as api, api.load_safetensors(ids, device="cpu") as host_tensors:
        for k, v in tensors.items():  # device -> host, at the copy's offsets
            assert np.array_equal(host_tensors[k], v), k
    for bufs in [*loads, sel["buffers"]]:
        for x in bufs:
            http.delete(f"/v1/buffers/{x['buffer_id']}")
