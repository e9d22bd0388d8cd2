"""The memory tier over REST, on a real uvicorn server: listed in ``GET /v1/tiers`` and the
policy, prefetched into (files and models), loads served from it (``source: memory``), its
bytes in ``/metrics``; naming it as a file's tier (upload, move, pin) is a 422 that changes
nothing; and ``target: memory`` without a memory tier is a 422."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import LiveServer, disk_snapshot, make_settings
from tests.placement.memory_support import MiB, memory_settings
from tierd_client import Client


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    with LiveServer(memory_settings(tmp_path / "data", quota=8 * MiB)) as srv:
        yield srv


@pytest.fixture
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def upload(http: httpx.Client, path: str, data: bytes, tier: str = "hdd") -> int:
    r = http.put("/v1/files/content", params={"path": path, "tier": tier}, content=data)
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def finished(http: httpx.Client, r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    deadline = time.monotonic() + 30
    while True:
        job: dict[str, Any] = http.get(f"/v1/jobs/{job_id}").json()
        if job["state"] in ("done", "failed", "cancelled") or time.monotonic() > deadline:
            return job
        time.sleep(0.02)


def sample(metrics: str, series: str) -> float | None:
    for line in metrics.splitlines():
        name, _, value = line.rpartition(" ")
        if name == series:
            return float(value)
    return None


def test_the_memory_tier_over_rest(server: LiveServer, http: httpx.Client) -> None:
    tiers = http.get("/v1/tiers").json()
    assert [(t["name"], t["rank"], t["kind"]) for t in tiers] == [
        ("ram", -1, "memory"),
        ("nvme", 0, "directory"),
        ("ssd", 1, "directory"),
        ("hdd", 2, "directory"),
    ]
    ram = tiers[0]
    assert ram["quota_bytes"] == ram["capacity_bytes"] == 8 * MiB
    assert (ram["files"], ram["file_bytes"], ram["free_bytes"]) == (0, 0, 8 * MiB)
    policy = http.get("/v1/policy").json()["policy"]
    assert list(policy["tiers"]) == ["ram", "nvme", "ssd", "hdd"]
    assert policy["tiers"]["ram"]["min_heat"] == 200

    data = os.urandom(MiB + 7)
    fid = upload(http, "w.bin", data)
    job = finished(http, http.post("/v1/prefetch", json={"file_ids": [fid], "target": "memory"}))
    assert job["state"] == "done" and job["bytes_done"] == len(data), job
    ram = http.get("/v1/tiers").json()[0]
    assert (ram["files"], ram["file_bytes"]) == (1, len(data))
    assert http.get(f"/v1/files/{fid}").json()["tier"] == "hdd"  # its home did not change

    r = http.post("/v1/load", json={"file_id": fid, "device": "cpu"})
    assert r.status_code == 200, r.text
    lease = r.json()
    assert lease["source"] == "memory" and lease["io_path"] == "copy" and lease["tier"] == "hdd"
    # Where the load's time went, for a profile: the whole load, its read, the reply.
    timing = dict(p.split(";dur=") for p in r.headers["Server-Timing"].split(", "))
    assert set(timing) == {"load", "io", "reply"} and all(float(v) >= 0 for v in timing.values())
    assert float(timing["io"]) <= float(timing["load"])
    with Client(server.url) as api, api.open_buffer(lease["buffer_id"]) as buf:
        assert np.asarray(buf).tobytes() == data

    metrics = http.get("/metrics").text
    assert sample(metrics, 'tierd_memory_tier_bytes{tier="ram"}') == len(data)
    assert sample(metrics, 'tierd_memory_tier_files{tier="ram"}') == 1
    assert sample(metrics, 'tierd_memory_tier_fills_total{tier="ram"}') == 1
    assert sample(metrics, 'tierd_tier_quota_bytes{tier="ram"}') == 8 * MiB
    assert sample(metrics, 'tierd_catalog_files{tier="ram"}') is None  # no file lives there

    # A model, as one job.
    for i in range(2):
        upload(http, f"models/t/model-{i}.safetensors", bytes([i]) * 1000)
    r = http.post("/v1/models/prefetch", params={"name": "models/t"}, json={"target": "memory"})
    job = finished(http, r)
    assert job["state"] == "done" and job["files_done"] == 2, job
    assert http.get("/v1/tiers").json()[0]["files"] == 3


def test_naming_the_memory_tier_as_a_files_home_is_a_422(
    server: LiveServer, http: httpx.Client
) -> None:
    fid = upload(http, "models/m/model.safetensors", b"\0" * 100)
    before = http.get("/v1/files").json()
    snap = disk_snapshot(server.settings.data_dir)
    attempts = [
        http.put("/v1/files/content", params={"path": "new.bin", "tier": "ram"}, content=b"x"),
        http.post("/v1/migrations", json={"file_id": fid, "to_tier": "ram"}),
        http.post("/v1/migrations", params={"wait": True}, json={"file_id": fid, "to_tier": "ram"}),
        http.post(f"/v1/files/{fid}/pin", json={"tier": "ram"}),
        http.post("/v1/models/pin", params={"name": "models/m"}, json={"tier": "ram"}),
    ]
    for r in attempts:
        assert r.status_code == 422, (r.request.url, r.text)
        err = r.json()["error"]
        assert err["code"] == "cache_only_tier" and "holds cached copies" in err["message"]
        assert err["tier"] == "ram"
    assert http.get("/v1/files").json() == before
    assert http.get("/v1/migrations").json()["items"] == []
    assert disk_snapshot(server.settings.data_dir) == snap


def test_target_memory_without_a_memory_tier_is_a_422(tmp_path: Path) -> None:
    with LiveServer(make_settings(tmp_path / "data", watch=False)) as srv, srv.client() as http:
        fid = upload(http, "models/t/model.safetensors", b"\0" * 10)
        for r in (
            http.post("/v1/prefetch", json={"file_ids": [fid], "target": "memory"}),
            http.post(
                "/v1/models/prefetch", params={"name": "models/t"}, json={"target": "memory"}
            ),
        ):
            assert r.status_code == 422, r.text
            assert "needs a memory tier" in r.json()["error"]["message"]
        assert http.get("/v1/jobs").json() == []
        assert [t["kind"] for t in http.get("/v1/tiers").json()] == ["directory"] * 3
