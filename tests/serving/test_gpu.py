"""CUDA IPC: a second, spawned process opens the handles of a load, a gather and a safetensors
load through tierd_client, checks them against the files, and hands them to torch and CuPy
without a copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import LiveServer, make_settings
from tests.serving.conftest import MiB

pytestmark = pytest.mark.gpu

CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import cupy as cp
    import torch
    from tierd_client import Client

    args = json.loads(sys.argv[1])
    blob = open(args["file"], "rb").read()
    report = {}
    with Client(args["url"]) as api:
        # A load: float32 items of a byte range.
        with api.load(args["id"], offset=4096, length=len(blob) - 8192, device="cuda:0",
                      dtype="float32", shape=[-1, 64]) as b:
            h = b.info["handle"]
            assert h["kind"] == "cuda_ipc" and h["alloc_bytes"] % (2 << 20) == 0
            assert h["gpu_uuid"].startswith("GPU-")
            report["io_path"] = b.info["io_path"]
            ptr = b.__cuda_array_interface__["data"][0]
            t = torch.from_dlpack(b)
            assert t.is_cuda and t.data_ptr() == ptr, "torch copied"
            assert t.dtype == torch.float32 and tuple(t.shape) == b.shape
            c = cp.from_dlpack(b)
            assert c.data.ptr == ptr
            assert cp.asarray(b).data.ptr == ptr  # __cuda_array_interface__
            assert cp.asnumpy(c).tobytes() == blob[4096:-4096]
            del t, c
        # A gather by indices, and one by start and count.
        m = np.frombuffer(blob, dtype=np.float32).reshape(-1, 256)
        idx = [7, 3, 3, 100, 0, len(m) - 1]
        with api.gather(args["id"], dim=256, indices=idx, device="cuda:0") as b:
            t = torch.from_dlpack(b)
            assert t.data_ptr() == b.__cuda_array_interface__["data"][0]
            assert t.cpu().numpy().tobytes() == m[idx].tobytes()
        with api.gather(args["id"], dim=256, start=5, count=50, device="cuda:0") as b:
            assert cp.asnumpy(b.array).tobytes() == m[5:55].tobytes()
        # safetensors shards, with a bf16 tensor.
        with api.load_safetensors(args["shards"], device="cuda:0") as ts:
            tt = ts.torch()
            want = torch.load(args["want"])
            assert sorted(tt) == sorted(want)
            by_id = {b.id: b for b in ts.buffers}
            for name, v in want.items():
                assert tt[name].dtype == v.dtype, name
                assert torch.equal(tt[name].cpu(), v), name
            for name, t in tt.items():  # every tensor points into a shard's allocation
                base = [b for b in ts.buffers
                        if 0 <= t.data_ptr() - b.__cuda_array_interface__["data"][0] < b.nbytes]
                assert base, name
        assert sum(api.buffers()["leased_bytes"].values()) == 0
    print("child ok", json.dumps(report))
    """
)


def test_second_process_opens_cuda_ipc_handles(data_dir, tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    settings = make_settings(data_dir, watch=False)
    blob = os.urandom(3 * MiB + 4 * 1024 * 4)  # rows of 256 float32
    with LiveServer(settings) as srv:
        import httpx

        http = httpx.Client(base_url=srv.url, timeout=60)

        def up(path: str, data: bytes) -> int:
            r = http.put("/v1/files/content", params={"path": path}, content=data)
            assert r.status_code == 201, r.text
            return int(r.json()["id"])

        fid = up("m.bin", blob)
        want = {
            "w": torch.randn(64, 32),
            "b": torch.arange(10, dtype=torch.int64),
            "h": torch.randn(8, 8).to(torch.bfloat16),
        }
        shards = []
        for i, names in enumerate((["w", "b"], ["h"])):
            p = tmp_path / f"s{i}.safetensors"
            save_file({k: want[k] for k in names}, str(p))
            shards.append(up(f"s{i}.safetensors", p.read_bytes()))
        torch.save(want, tmp_path / "want.pt")
        (tmp_path / "m.bin").write_bytes(blob)
        args = {
            "url": srv.url,
            "id": fid,
            "file": str(tmp_path / "m.bin"),
            "shards": shards,
            "want": str(tmp_path / "want.pt"),
        }
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
        }
        done = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        print(done.stdout, done.stderr)
        assert done.returncode == 0, done.stderr
        assert "child ok" in done.stdout
        assert http.get("/v1/buffers").json()["leased_bytes"].get("cuda:0", 0) == 0
        http.close()


def test_gpu_budget_and_shutdown(data_dir):
    import httpx

    settings = make_settings(data_dir, watch=False, buffers={"gpu_budget_bytes": 8 * MiB})
    with LiveServer(settings) as srv:
        http = httpx.Client(base_url=srv.url, timeout=60)
        fid = http.put(
            "/v1/files/content", params={"path": "g.bin"}, content=b"g" * (3 * MiB)
        ).json()["id"]
        first = http.post("/v1/load", json={"file_id": fid, "device": "cuda:0"})
        assert first.status_code == 200 and first.json()["alloc_bytes"] == 4 * MiB
        assert http.post("/v1/load", json={"file_id": fid, "device": "cuda:0"}).status_code == 200
        r = http.post("/v1/load", json={"file_id": fid, "device": "cuda:0"})
        assert r.status_code == 507 and r.json()["error"]["free"] == 0
        bad = http.post("/v1/load", json={"file_id": fid, "device": "cuda:64"})
        assert bad.status_code == 422
        http.close()
        loader = srv.server.config.app.state.loader
    assert loader.leases.leased_bytes()["cuda:0"] == 0  # freed at shutdown
