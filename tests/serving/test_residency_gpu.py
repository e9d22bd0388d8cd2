"""GPU residency: loads of a file already on a GPU in tierd's hands are copies on that GPU
(source ``gpu``) or from another one (``peer``), ``shared=true`` hands a second process the
same allocation, and the copy outlives its last lease.

The server runs in this process; a spawned second process opens the handles (a process
cannot open its own CUDA IPC handle) and checks them against the file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import LiveServer, make_settings
from tests.serving.conftest import MiB

pytestmark = pytest.mark.gpu

CHILD = textwrap.dedent(
    """
    import json, sys
    import cupy as cp
    import torch
    from tierd_client import Client

    args = json.loads(sys.argv[1])
    blob = open(args["file"], "rb").read()
    out = {}
    with Client(args["url"]) as api:
        for bid in args["open"]:
            b = api.open_buffer(bid, release_on_close=False)
            cai = b.__cuda_array_interface__ if b.is_cuda else None
            seen = {"same": (cp.asnumpy(b.array) if b.is_cuda else b.array).tobytes() == blob,
                    "read_only": b.read_only}
            if cai is not None:
                ptr, ro = cai["data"]
                seen["ptr"], seen["cai_read_only"] = ptr, ro
                t = torch.from_dlpack(b)
                seen["torch_zero_copy"] = t.data_ptr() == ptr
                seen["cupy_zero_copy"] = cp.asarray(b).data.ptr == ptr
                try:
                    torch.as_tensor(b, device="cuda")
                    seen["as_tensor"] = "took it"
                except TypeError:
                    seen["as_tensor"] = "refused"
                del t
            out[bid] = seen
            b.close(release=False)
        if args.get("shared"):
            before = sum(api.buffers()["leased_bytes"].values())
            with api.load(args["shared"], device="cuda:0", shared=True) as b:
                out["shared"] = {
                    "ipc": b.info["handle"]["ipc_handle"], "reused": b.reused,
                    "same": cp.asnumpy(b.array).tobytes() == blob,
                    "extra_bytes": sum(api.buffers()["leased_bytes"].values()) - before,
                }
    print(json.dumps(out))
    """
)


def _gpus() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


@pytest.fixture
def srv(data_dir: Path) -> Iterator[LiveServer]:
    settings = make_settings(data_dir, watch=False, buffers={"gpu_budget_bytes": 256 * MiB})
    with LiveServer(settings) as s:
        yield s


@pytest.fixture
def http(srv: LiveServer) -> Iterator[httpx.Client]:
    with srv.client() as c:
        yield c


def _child(srv: LiveServer, file: Path, open_ids: list[str], shared: int | None = None) -> Any:
    args = {"url": srv.url, "file": str(file), "open": open_ids, "shared": shared}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _upload(http: httpx.Client, tmp_path: Path, name: str, size: int) -> tuple[int, Path]:
    data = os.urandom(size)
    local = tmp_path / name
    local.write_bytes(data)
    r = http.put("/v1/files/content", params={"path": name}, content=data)
    assert r.status_code == 201, r.text
    return int(r.json()["id"]), local


def _load(http: httpx.Client, fid: int, device: str, shared: bool = False) -> dict[str, Any]:
    r = http.post("/v1/load", json={"file_id": fid, "device": device, "shared": shared})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _leased(http: httpx.Client) -> int:
    return sum(http.get("/v1/buffers").json()["leased_bytes"].values())


def test_same_gpu_shared_and_copied_loads(srv, http, tmp_path):
    fid, local = _upload(http, tmp_path, "res.bin", 5 * MiB + 12_345)
    first = _load(http, fid, "cuda:0", shared=True)
    assert first["read_only"] and not first["reused"] and first["source"] == "page_cache"
    one_copy = _leased(http)
    again = _load(http, fid, "cuda:0", shared=True)
    assert again["handle"]["ipc_handle"] == first["handle"]["ipc_handle"] and again["reused"]
    assert again["source"] == "gpu" and _leased(http) == one_copy
    own = _load(http, fid, "cuda:0")  # a load of its own: copied device -> device
    assert own["source"] == "gpu" and own["io_path"] == "copy" and not own["read_only"]
    assert own["handle"]["ipc_handle"] != first["handle"]["ipc_handle"]
    host = _load(http, fid, "cpu")  # device -> host
    assert host["source"] == "gpu" and host["io_path"] == "copy"
    ids = [first["buffer_id"], again["buffer_id"], own["buffer_id"], host["buffer_id"]]
    seen = _child(srv, local, ids, shared=fid)
    a, b, c, d = (seen[i] for i in ids)
    assert all(x["same"] for x in (a, b, c, d)), seen
    assert a["cai_read_only"] is True and c["cai_read_only"] is False
    assert a["ptr"] == b["ptr"]  # one allocation, mapped once in the second process
    assert a["torch_zero_copy"] and a["cupy_zero_copy"] and c["torch_zero_copy"]
    assert a["as_tensor"] == "refused" and c["as_tensor"] == "took it"
    # The second process's own shared load: the same allocation, no extra bytes.
    sh = seen["shared"]
    assert sh["ipc"] == first["handle"]["ipc_handle"] and sh["reused"] and sh["same"]
    assert sh["extra_bytes"] == 0
    stats = http.get("/v1/stats").json()
    assert stats["by_source"]["gpu"]["operations_completed"] >= 4
    assert stats["by_path"]["copy"]["bytes_transferred"] == 2 * local.stat().st_size
    # The resident copy outlives its last lease (kept: see test_residency_keep_gpu.py): the
    # next load still copies from it, and a shared one is handed the same allocation.
    for i in (first["buffer_id"], again["buffer_id"]):
        assert http.delete(f"/v1/buffers/{i}").status_code == 200
    after = _load(http, fid, "cuda:0")
    assert after["source"] == "gpu" and after["io_path"] == "copy"
    back = _load(http, fid, "cuda:0", shared=True)
    assert back["reused"] and back["handle"]["ipc_handle"] == first["handle"]["ipc_handle"]
    for i in (own["buffer_id"], host["buffer_id"], after["buffer_id"], back["buffer_id"]):
        http.delete(f"/v1/buffers/{i}")
    assert _leased(http) == 0


def test_gpu_prefetch_is_shared_and_copied(srv, http, tmp_path):
    fid, local = _upload(http, tmp_path, "warm.bin", 3 * MiB + 7)
    r = http.post("/v1/prefetch", json={"file_ids": [fid], "target": "gpu", "device": "cuda:0"})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    deadline = time.monotonic() + 60
    while (job := http.get(f"/v1/jobs/{job_id}").json())["state"] not in ("done", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (warm_id,) = job["buffer_ids"]
    warm = http.get(f"/v1/buffers/{warm_id}").json()
    assert warm["read_only"] is True
    shared = _load(http, fid, "cuda:0", shared=True)
    assert shared["reused"] and shared["handle"]["ipc_handle"] == warm["handle"]["ipc_handle"]
    own = _load(http, fid, "cuda:0")
    assert own["source"] == "gpu"
    seen = _child(srv, local, [warm_id, shared["buffer_id"], own["buffer_id"]])
    assert all(x["same"] for x in seen.values()), seen
    for i in (warm_id, shared["buffer_id"], own["buffer_id"]):
        http.delete(f"/v1/buffers/{i}")
    assert _leased(http) == 0


def test_shared_safetensors_on_gpu(srv, http, tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    p = tmp_path / "s.safetensors"
    save_file({"w": rng.standard_normal((256, 256)).astype(np.float32)}, str(p))
    r = http.put("/v1/files/content", params={"path": "st/s.safetensors"}, content=p.read_bytes())
    sid = r.json()["id"]
    body = {"file_ids": [sid], "device": "cuda:0", "shared": True}
    one = http.post("/v1/load/safetensors", json=body).json()
    before = _leased(http)
    two = http.post("/v1/load/safetensors", json=body).json()
    (b1,), (b2,) = one["buffers"], two["buffers"]
    assert b2["reused"] and b2["handle"]["ipc_handle"] == b1["handle"]["ipc_handle"]
    assert two["tensors"]["w"]["offset"] == one["tensors"]["w"]["offset"]
    assert _leased(http) == before
    for b in (b1, b2):
        http.delete(f"/v1/buffers/{b['buffer_id']}")
    assert _leased(http) == 0


def test_cross_gpu_loads_copy_from_the_other_gpu(srv, http, tmp_path):
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    import cupy

    fid, local = _upload(http, tmp_path, "peer.bin", 6 * MiB + 3)
    resident = _load(http, fid, "cuda:0", shared=True)
    other = _load(http, fid, "cuda:1")
    if cupy.cuda.runtime.deviceCanAccessPeer(1, 0):
        assert other["source"] == "peer" and other["io_path"] == "copy"
    else:  # no peer access: the host path, from the page cache
        assert other["source"] == "page_cache" and other["io_path"] != "copy"
    seen = _child(srv, local, [resident["buffer_id"], other["buffer_id"]])
    assert all(x["same"] for x in seen.values()), seen
    for i in (resident["buffer_id"], other["buffer_id"]):
        http.delete(f"/v1/buffers/{i}")
    assert _leased(http) == 0
