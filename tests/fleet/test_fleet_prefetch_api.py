"""Fleet prefetch over REST on two real tierd servers (uvicorn on loopback) with their own host
ids and data directories, sharing one PostgreSQL catalog and one bucket (moto): a model warmed
into both hosts' memory tiers by one request, with progress per host and in total; a job
cancelled; a task for a host that went silent failed with the reason; and bad requests
answered with a JSON 4xx that records nothing."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import save

from tests.catalog.conftest import run_sql
from tests.conftest import disk_snapshot, make_settings, wait_for
from tests.fleet.procs import live_pair, object_tier
from tiering.catalog.db import Database
from tiering.catalog.hosts import Hosts

MiB = 1 << 20
MODEL = {
    "llm/model.safetensors": save({"w": np.arange(64 * 1024, dtype=np.float32)}),
    "llm/config.json": json.dumps({"hidden_size": 64}).encode(),
}
JOBS = "SELECT count(*) FROM fleet_jobs"
TASKS = "SELECT count(*) FROM fleet_tasks"


def _settings(root: Path, host: str, pg_url: str, endpoint: str, bucket: str) -> Any:
    return make_settings(
        root,
        host_id=host,
        catalog_url=pg_url,
        heartbeat_interval_s=0.1,
        fleet_poll_interval_s=0.1,
        # Not tighter: on a loaded machine (the suite on 2 cores) a host's beat can lag a
        # second, and a 1 s limit failed a live host's task.
        fleet_task_timeout_s=5.0,
        watch=False,
        memory_floor_bytes=0,
        tiers=[
            {"name": "ram", "kind": "memory", "quota_bytes": 8 * MiB},
            {"name": "nvme", "path": root / "nvme"},
            {**object_tier(endpoint, bucket), "connections": 2},
        ],
        buffers={"cpu_budget_bytes": 16 * MiB},
    )


@pytest.fixture
def fleet(
    tmp_path: Path, pg_url: str, moto_endpoint: str, s3_bucket: str, s3_client: Any, s3_env: Any
) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    def settings_of(root: Path, host: str) -> Any:
        return _settings(root, host, pg_url, moto_endpoint, s3_bucket)

    with live_pair(tmp_path, MODEL, s3_client, s3_bucket, settings_of) as pair:
        yield pair


def _finished(c: httpx.Client, job_id: int) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        doc: dict[str, Any] = c.get(f"/v1/fleet/jobs/{job_id}").json()
        return doc if doc["state"] not in ("queued", "running") else None

    return dict(wait_for(done, what=f"fleet job {job_id} to finish"))


def _register_silent(pg_url: str, host: str, now: float | None = None) -> None:
    """A host that registered (and, with ``now`` in the past, last beat then) and went away."""
    db = Database(pg_url)
    try:
        Hosts(db).register(host, address=f"http://{host}:1", version="t", report="{}", now=now)
    finally:
        db.dispose()


def test_a_model_reaches_every_hosts_memory_with_progress(
    fleet: tuple[httpx.Client, httpx.Client], pg_url: str
) -> None:
    ca, cb = fleet
    r = cb.post("/v1/fleet/prefetch", json={"model": "llm", "target": "memory"})
    assert r.status_code == 202, r.text
    job = r.json()
    assert r.headers["location"] == f"/v1/fleet/jobs/{job['id']}"
    assert job["created_by"] == "host-b" and job["model"] == "llm"
    assert [t["host"] for t in job["hosts"]] == ["host-a", "host-b"]  # "all": both are up
    size = sum(len(d) for d in MODEL.values())
    assert (job["files_total"], job["bytes_total"]) == (4, 2 * size)
    assert {f["path"] for f in job["files"]} == set(MODEL)

    doc = _finished(ca, job["id"])  # followed from the other host: one shared catalog
    assert doc["state"] == "done", doc
    assert (doc["files_done"], doc["bytes_done"], doc["progress"]) == (4, 2 * size, 1.0)
    for t in doc["hosts"]:
        assert (t["state"], t["claimed_by"], t["attempts"]) == ("done", t["host"], 1), t
        assert (t["files_done"], t["bytes_done"], t["errors"]) == (2, size, []), t
    # Each host holds the model in its own memory tier, and loads it from there.
    out = ca.get("/v1/fleet/locate", params={"model": "llm"}).json()
    assert {(h["host_id"], h["warmth"], h["complete"]) for h in out["hosts"]} == {
        ("host-a", "memory", True),
        ("host-b", "memory", True),
    }
    for c in (ca, cb):
        r = c.post("/v1/load", json={"path": "llm/model.safetensors", "device": "cpu"})
        assert r.status_code == 200, r.text
        assert r.json()["source"] == "memory"
        assert c.delete(f"/v1/buffers/{r.json()['buffer_id']}").status_code in (200, 204)
    # Each host ran its part as a local job too.
    assert [j["target"] for j in ca.get("/v1/jobs").json()] == ["memory"]

    # A job for a host that never runs it: cancelled, as the list shows.
    _register_silent(pg_url, "host-c")
    r = ca.post(
        "/v1/fleet/prefetch",
        json={"paths": ["llm/config.json"], "hosts": ["host-c"], "target": "page_cache"},
    )
    assert r.status_code == 202, r.text
    cancelled = cb.delete(f"/v1/fleet/jobs/{r.json()['id']}").json()
    assert cancelled["state"] == "cancelled" and cancelled["hosts"][0]["state"] == "cancelled"
    page = ca.get("/v1/fleet/jobs", params={"limit": 1}).json()
    assert [j["id"] for j in page["items"]] == [cancelled["id"]]
    rest = ca.get("/v1/fleet/jobs", params={"cursor": page["next_cursor"]}).json()
    assert [j["id"] for j in rest["items"]] == [job["id"]] and rest["next_cursor"] is None


def test_a_silent_hosts_task_fails_with_the_reason(
    fleet: tuple[httpx.Client, httpx.Client], pg_url: str
) -> None:
    ca, _ = fleet
    # Silent for 10 s: still up (host_timeout_s is 30 s), over the task timeout (5 s).
    _register_silent(pg_url, "host-c", now=time.time() - 10)
    r = ca.post(
        "/v1/fleet/prefetch",
        json={"paths": ["llm/config.json"], "hosts": ["host-a", "host-c"], "target": "page_cache"},
    )
    assert r.status_code == 202, r.text
    doc = _finished(ca, r.json()["id"])
    assert doc["state"] == "failed", doc
    t = {x["host"]: x for x in doc["hosts"]}
    assert t["host-a"]["state"] == "done"
    assert t["host-c"]["state"] == "failed" and t["host-c"]["attempts"] == 0
    assert t["host-c"]["error"].startswith("host host-c has been down since ")
    assert "over fleet_task_timeout_s=5" in t["host-c"]["error"]


def test_a_bad_fleet_request_is_a_json_4xx_and_records_nothing(
    fleet: tuple[httpx.Client, httpx.Client], tmp_path: Path, pg_url: str
) -> None:
    ca, _ = fleet
    _register_silent(pg_url, "host-old", now=1.0)
    model = {"model": "llm", "target": "memory"}
    bad: list[tuple[dict[str, Any], int, str | None]] = [
        ({"target": "memory"}, 422, None),
        ({"model": "llm", "paths": ["llm/config.json"], "target": "memory"}, 422, None),
        ({"model": "llm", "target": "disk"}, 422, None),
        ({"model": "llm"}, 422, None),
        ({"paths": [], "target": "memory"}, 422, None),
        ({"paths": ["x"] * 1025, "target": "memory"}, 422, None),
        ({"paths": ["../etc/passwd"], "target": "memory"}, 422, "invalid_path"),
        ({"model": "/abs", "target": "memory"}, 422, "invalid_path"),
        ({**model, "hosts": []}, 422, None),
        ({**model, "hosts": "some"}, 422, None),
        ({**model, "hosts": ["host-a", "host-z"]}, 422, "unknown_host"),
        ({**model, "hosts": ["host-a", "host-old"]}, 422, "host_down"),
        ({**model, "device": "cuda:0"}, 422, None),
        ({"model": "llm", "target": "gpu", "device": "tpu:0"}, 422, None),
        ({**model, "extra": 1}, 422, None),
        ({"paths": ["llm/nope.bin"], "target": "memory"}, 404, None),
        ({"model": "nope", "target": "memory"}, 404, None),
    ]
    before = disk_snapshot(tmp_path / "a"), disk_snapshot(tmp_path / "b")
    for body, status, code in bad:
        r = ca.post("/v1/fleet/prefetch", json=body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["message"] and (code is None or err["code"] == code), (body, err)
    down = ca.post("/v1/fleet/prefetch", json={**model, "hosts": ["host-old"]}).json()
    assert "host-old" in down["error"]["message"]
    for path in ("/v1/fleet/jobs/12345", "/v1/fleet/jobs/0", "/v1/fleet/jobs/x"):
        assert ca.get(path).status_code in (404, 422)
        assert ca.delete(path).json()["error"]["message"]
    assert ca.get("/v1/fleet/jobs/12345").json()["error"]["code"] == "job_not_found"
    assert ca.get("/v1/fleet/jobs", params={"limit": 0}).status_code == 422
    assert run_sql(pg_url, JOBS) == [(0,)] and run_sql(pg_url, TASKS) == [(0,)]
    assert (disk_snapshot(tmp_path / "a"), disk_snapshot(tmp_path / "b")) == before
