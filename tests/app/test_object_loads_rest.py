"""Loads of files on an object-store tier over REST: a real uvicorn server whose second tier is
a bucket prefix on a real S3 server (moto, over HTTP), models adopted at start without a copy,
every load endpoint into ``cpu`` through tierd_client (``cuda:0`` from a second process on the
GPU machine), and an object changed behind tierd's back answered with 409 and nothing served."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import save

from tests.conftest import LiveServer, make_settings
from tests.s3 import REGION
from tierd_client import Client, Conflict

PART = 64 << 10
MiB = 1 << 20


@pytest.fixture
def model(s3_client: Any, s3_bucket: str) -> dict[str, Any]:
    """A model directory in the bucket before tierd starts: safetensors, a matrix, a blob."""
    rng = np.random.default_rng(7)
    tensors: dict[str, np.ndarray] = {
        "wte": rng.standard_normal((128, 64)).astype(np.float32),
        "ln": rng.standard_normal(64).astype(np.float16),
    }
    emb = rng.standard_normal((2048, 32)).astype(np.float32)
    blob = rng.integers(0, 256, 3 * PART + 17, dtype=np.uint8).tobytes()
    files = {
        "llm/model.safetensors": save(tensors),
        "llm/emb.f32": emb.tobytes(),
        "llm/blob.bin": blob,
    }
    for rel, data in files.items():
        s3_client.put_object(Bucket=s3_bucket, Key=f"models/{rel}", Body=data)
    return {"tensors": tensors, "emb": emb, "blob": blob, "files": files}


@pytest.fixture
def server(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str, s3_env: Any, model: dict[str, Any]
) -> Iterator[LiveServer]:
    settings = make_settings(
        tmp_path / "data",
        watch=False,
        tiers=[
            {"name": "nvme", "path": tmp_path / "data" / "nvme"},
            {
                "name": "s3",
                "url": f"s3://{s3_bucket}/models",
                "endpoint_url": moto_endpoint,
                "region": REGION,
                "connections": 4,
            },
        ],
        buffers={"cpu_budget_bytes": 64 * MiB, "reap_interval_s": 0.05},
    )
    with LiveServer(settings) as srv:
        yield srv


@pytest.fixture
def api(server: LiveServer) -> Iterator[Client]:
    with Client(server.url) as c:
        yield c


def test_every_load_over_rest_reads_the_bucket(
    api: Client, server: LiveServer, model: dict[str, Any]
) -> None:
    blob, emb = model["blob"], model["emb"]
    # Adopted at start, in place: on the s3 tier, nothing copied to nvme.
    rec = api.file("llm/blob.bin")
    assert rec["tier"] == "s3" and rec["size"] == len(blob)
    assert not any(p.is_file() for p in (server.settings.data_dir / "nvme").rglob("*"))
    with api.load("llm/blob.bin") as b:
        assert np.asarray(b).tobytes() == blob
        assert (b.info["io_path"], b.info["tier"]) == ("remote", "s3")
    with api.load(rec["id"], offset=PART - 1, length=PART + 2) as b:
        assert np.asarray(b).tobytes() == blob[PART - 1 : 2 * PART + 1]
    with api.load_safetensors("llm/model.safetensors") as t:
        for name, want in model["tensors"].items():
            assert np.asarray(t[name]).tobytes() == want.tobytes(), name
    idx = [2047, 3, 3, 1000, 4, 0]
    with api.gather("llm/emb.f32", dim=32, indices=idx) as b:
        assert np.asarray(b).tobytes() == emb[idx].tobytes()
    bufs = api.load_batch(["llm/blob.bin", {"file": "llm/emb.f32", "offset": 128, "length": 256}])
    assert np.asarray(bufs[0]).tobytes() == blob
    assert np.asarray(bufs[1]).tobytes() == emb.tobytes()[128:384]
    for b in bufs:
        b.close()
    # Byte ranges of the content, streamed from the bucket.
    with httpx.Client(base_url=server.url) as http:
        r = http.get(f"/v1/files/{rec['id']}/content", headers={"Range": "bytes=10-99999"})
        assert r.status_code == 206 and r.content == blob[10:100000]
        metrics = http.get("/metrics").text
    assert 'io_path="remote"' in metrics and 'tier="s3"' in metrics
    stats = api.stats()
    assert stats["by_path"]["remote"]["operations_completed"] >= 6
    assert stats["by_tier"]["s3"]["bytes_transferred"] >= 2 * len(blob)
    assert sum(api.buffers()["leased_bytes"].values()) == 0


CHILD = textwrap.dedent(
    """
    import json, sys
    import cupy as cp
    import numpy as np
    from tierd_client import Client

    a = json.loads(sys.argv[1])
    blob = open(a["blob"], "rb").read()
    emb = np.load(a["emb"])
    with Client(a["url"]) as api:
        with api.load("llm/blob.bin", device="cuda:0") as b:
            assert b.info["io_path"] == "remote"
            assert cp.asnumpy(cp.asarray(b)).tobytes() == blob
        with api.load("llm/blob.bin", offset=70000, length=90000, device="cuda:0") as b:
            assert cp.asnumpy(cp.asarray(b)).tobytes() == blob[70000:160000]
        idx = [2047, 3, 3, 1000, 4, 0]
        with api.gather("llm/emb.f32", dim=32, indices=idx, device="cuda:0") as b:
            assert cp.asnumpy(cp.asarray(b)).tobytes() == emb[idx].tobytes()
        with api.load_safetensors("llm/model.safetensors", device="cuda:0") as t:
            for name in ("wte", "ln"):
                want = np.load(a[name])
                assert cp.asnumpy(cp.asarray(t[name])).tobytes() == want.tobytes(), name
        assert sum(api.buffers()["leased_bytes"].values()) == 0
    print("child ok")
    """
)


@pytest.mark.gpu
def test_rest_loads_into_cuda_in_a_second_process(
    server: LiveServer, model: dict[str, Any], tmp_path: Path
) -> None:
    (tmp_path / "blob.bin").write_bytes(model["blob"])
    args = {"url": server.url, "blob": str(tmp_path / "blob.bin")}
    for name, arr in {"emb": model["emb"], **model["tensors"]}.items():
        np.save(tmp_path / f"{name}.npy", arr)
        args[name] = str(tmp_path / f"{name}.npy")
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
    assert done.returncode == 0 and "child ok" in done.stdout, done.stderr


def test_a_changed_object_is_409_and_nothing_is_served(
    api: Client, server: LiveServer, s3_client: Any, s3_bucket: str, model: dict[str, Any]
) -> None:
    rec = api.file("llm/blob.bin")
    s3_client.put_object(Bucket=s3_bucket, Key="models/llm/blob.bin", Body=b"z" * rec["size"])
    with pytest.raises(Conflict) as exc:
        api.load(rec["id"])
    assert exc.value.status == 409 and exc.value.code == "file_changed"
    assert "changed behind tierd's back" in exc.value.message and "ETag" in exc.value.message
    with pytest.raises(Conflict):
        api.gather("llm/blob.bin", dim=1, dtype="uint8", indices=[0])
    with httpx.Client(base_url=server.url) as http:
        r = http.get(f"/v1/files/{rec['id']}/content")
        assert r.status_code == 409 and r.json()["error"]["code"] == "file_changed"
        r = http.post("/v1/load/batch", json={"items": [{"path": "llm/blob.bin"}]})
        assert r.status_code == 409, r.text
    assert sum(api.buffers()["leased_bytes"].values()) == 0
    assert api.buffers()["items"] == []
    # The file itself is untouched in the catalog until scan looks at it.
    assert api.file(rec["id"])["tier"] == "s3"


def test_prefetch_to_nvme_pulls_a_model_down(api: Client, model: dict[str, Any]) -> None:
    ids = [api.file(rel)["id"] for rel in model["files"]]
    job = api.prefetch(ids, target="nvme", wait=True, progress=False)
    assert job["state"] == "done", job
    assert job["bytes_done"] == job["bytes_total"] == sum(len(d) for d in model["files"].values())
    for rel, data in model["files"].items():
        assert api.file(rel)["tier"] == "nvme"
        with api.load(rel) as b:
            assert np.asarray(b).tobytes() == data
            assert b.info["io_path"] == "host"
