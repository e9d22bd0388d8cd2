"""Three real tierd processes (``tierd serve``, each its own host id, data directory and port)
sharing one PostgreSQL catalog and one bucket on a real S3-protocol server (moto): they see
each other and read the shared model; one fleet prefetch puts a copy of the model on every
host (locate before and after, the bytes checked on each host, the bucket still the origin);
a host killed -9 mid-prefetch takes its task again when restarted and finishes it; with
PostgreSQL stopped mid-prefetch every host still serves the model, and when it is back the
job ends done on every host with no file failed. The last two run with ``--runslow``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import save

from tests.conftest import wait_for
from tests.fleet.procs import TierdProcess, fleet_of
from tests.pg_support import PausablePg
from tests.s3_faults import FaultProxy

MODEL = {
    "llm/model-00001-of-00002.safetensors": save({"a": np.arange(50_000, dtype=np.float32)}),
    "llm/model-00002-of-00002.safetensors": save({"b": np.arange(70_000, dtype=np.int32)}),
    "llm/config.json": json.dumps({"hidden_size": 64}).encode(),
}


@pytest.fixture
def three(
    tmp_path: Path, pg_url: str, moto_endpoint: str, s3_bucket: str, s3_client: Any, s3_env: Any
) -> Iterator[list[TierdProcess]]:
    for rel, data in MODEL.items():
        s3_client.put_object(Bucket=s3_bucket, Key=f"models/{rel}", Body=data)
    with fleet_of(
        tmp_path, 3, catalog_url=pg_url, endpoint=moto_endpoint, bucket=s3_bucket
    ) as procs:
        yield procs


def _content(p: TierdProcess, path: str) -> bytes:
    with p.client() as c:
        fid = c.get("/v1/files/lookup", params={"path": path}).json()["id"]
        r = c.get(f"/v1/files/{fid}/content")
        assert r.status_code == 200, r.text
        return r.content


def _see_each_other_and_read_the_model(three: list[TierdProcess]) -> None:
    for p in three:
        with p.client() as c:
            hosts = wait_for(
                lambda c=c: (
                    h
                    if len(h := c.get("/v1/fleet/hosts").json()["items"]) == 3
                    and all(x["state"] == "up" for x in h)
                    else None
                ),
                what="three hosts up",
            )
            assert sorted(h["host_id"] for h in hosts) == ["host-0", "host-1", "host-2"]
    with three[1].client() as c:
        r = c.get("/v1/fleet/locate", params={"model": "llm"})
        assert r.status_code == 200, r.text
        for f in r.json()["files"]:
            assert sorted(p["host_id"] for p in f["places"]) == ["host-0", "host-1", "host-2"]
            assert {p["kind"] for p in f["places"]} == {"object_store"}
    for p in three:
        for rel, data in MODEL.items():
            assert _content(p, rel) == data


def _hold_back_reads(proxy: FaultProxy) -> threading.Event:
    """Have ``proxy`` hold each ranged GET back half a second while the event is set (it is),
    so that a host reading through it is still at work when the test acts."""
    slow = threading.Event()
    slow.set()

    def held_back(status: int, headers: Any, body: bytes) -> tuple[int, Any, bytes]:
        if slow.is_set():
            time.sleep(0.5)
        return status, headers, body

    proxy.fail("edit", method="GET", header="Range", times=10_000, edit=held_back)
    return slow


def _finished(c: httpx.Client, job_id: int, timeout: float = 60) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        doc: dict[str, Any] = c.get(f"/v1/fleet/jobs/{job_id}").json()
        return doc if doc["state"] not in ("queued", "running") else None

    return dict(wait_for(done, timeout=timeout, what=f"fleet job {job_id} to finish"))


def _check_local_copies(p: TierdProcess) -> None:
    """Every file of the model is in ``p``'s own copy on its nvme, right to the byte, and a
    load there reads that copy, not the bucket."""
    with p.client() as c:
        for rel, data in MODEL.items():
            rec = c.get("/v1/files/lookup", params={"path": rel}).json()
            assert rec["tier"] == "s3", rec  # the bucket stays the origin
            copy = p.root / "nvme" / ".tierd-copies" / f"{rec['id']}.{rec['generation']}"
            assert copy.read_bytes() == data
            r = c.post("/v1/load", json={"path": rel, "device": "cpu"})
            assert r.status_code == 200, r.text
            assert r.json()["source"] in ("page_cache", "storage"), r.json()
            assert c.delete(f"/v1/buffers/{r.json()['buffer_id']}").status_code in (200, 204)


# Suite time (~12 CPU-seconds): tests/fleet/test_distribution.py prefetches a model onto four
# real hosts in CI and checks every copy's bytes; this one adds locate's warmth and job counts.
@pytest.mark.slow
def test_a_fleet_prefetch_puts_the_model_on_all_three_hosts(three: list[TierdProcess]) -> None:
    _see_each_other_and_read_the_model(three)
    with three[0].client() as c:
        before = c.get("/v1/fleet/locate", params={"model": "llm"}).json()
        assert {h["host_id"]: h["warmth"] for h in before["hosts"]} == {
            f"host-{i}": "object_store" for i in range(3)
        }
        r = c.post("/v1/fleet/prefetch", json={"model": "llm", "target": "nvme"})
        assert r.status_code == 202, r.text
        job = r.json()
        assert sorted(t["host"] for t in job["hosts"]) == ["host-0", "host-1", "host-2"]
    with three[2].client() as c:
        doc = _finished(c, job["id"])
    assert doc["state"] == "done", doc
    assert doc["files_done"] == 3 * len(MODEL) and doc["progress"] == 1.0
    for p in three:
        _check_local_copies(p)
    with three[1].client() as c:
        after = c.get("/v1/fleet/locate", params={"model": "llm"}).json()
    for h in after["hosts"]:
        assert (h["warmth"], h["complete"]) == ("tier", True), h
    for f in after["files"]:
        kinds = {(pl["host_id"], pl["kind"]) for pl in f["places"]}
        assert {(f"host-{i}", "copy") for i in range(3)} <= kinds, f
        assert {(f"host-{i}", "object_store") for i in range(3)} <= kinds, f


# Slow (three processes, a kill and a restart: about 40 s on the 2-core box). Its fast sibling,
# tests/fleet/test_fleet_worker.py::test_a_task_held_by_a_dead_incarnation_is_run_again, runs
# the same claim-expiry path in-process.
@pytest.mark.slow
def test_a_host_killed_mid_prefetch_finishes_it_after_its_restart(
    tmp_path: Path,
    pg_url: str,
    moto_endpoint: str,
    s3_bucket: str,
    s3_client: Any,
    s3_env: Any,
    fault_proxy: FaultProxy,
) -> None:
    for rel, data in MODEL.items():
        s3_client.put_object(Bucket=s3_bucket, Key=f"models/{rel}", Body=data)
    # Host 2 reaches the bucket through a proxy that holds each read back, so its part of
    # the job is still running when it is killed.
    slow = _hold_back_reads(fault_proxy)
    with fleet_of(
        tmp_path,
        3,
        catalog_url=pg_url,
        endpoint=moto_endpoint,
        bucket=s3_bucket,
        endpoints={2: fault_proxy.url},
        settings={"fleet_poll_interval_s": 0.1, "fleet_claim_ttl_s": 2.0},
    ) as three:
        with three[0].client() as c:
            r = c.post("/v1/fleet/prefetch", json={"model": "llm", "target": "nvme"})
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]

            def host2() -> dict[str, Any]:
                doc = c.get(f"/v1/fleet/jobs/{job_id}").json()
                return dict(next(t for t in doc["hosts"] if t["host"] == "host-2"))

            wait_for(lambda: host2()["state"] == "running", what="host 2 at work")
            three[2].kill9()
            task = host2()
            assert (task["state"], task["claimed_by"], task["attempts"]) == (
                "running",
                "host-2",
                1,
            ), task
            # The others finish their parts; the job waits for host 2.
            wait_for(
                lambda: (
                    [t["state"] for t in c.get(f"/v1/fleet/jobs/{job_id}").json()["hosts"]].count(
                        "done"
                    )
                    == 2
                ),
                what="hosts 0 and 1 done",
            )
            assert c.get(f"/v1/fleet/jobs/{job_id}").json()["state"] == "running"
            slow.clear()
            three[2].start()
            doc = _finished(c, job_id)
        assert doc["state"] == "done", doc
        task = next(t for t in doc["hosts"] if t["host"] == "host-2")
        assert (task["state"], task["attempts"], task["errors"]) == ("done", 2, []), task
        for p in three:
            _check_local_copies(p)
        # No temp of the killed fill survived the restart.
        leftovers = [
            q.name for q in (three[2].root / "nvme").rglob("*") if q.name.endswith(".tierd-tmp")
        ]
        assert leftovers == []


# Slow (three processes and a PostgreSQL outage: about 45 s). Fast siblings:
# tests/fleet/test_degraded.py::test_postgresql_down_then_back (loads go on, work resumes) and
# tests/fleet/test_degraded_resume.py (a cut move settled when PostgreSQL returns).
@pytest.mark.slow
def test_postgresql_stopped_mid_prefetch_loads_go_on_and_the_job_resumes(
    tmp_path: Path,
    private_pg: PausablePg,
    moto_endpoint: str,
    s3_bucket: str,
    s3_client: Any,
    s3_env: Any,
    fault_proxy: FaultProxy,
) -> None:
    for rel, data in MODEL.items():
        s3_client.put_object(Bucket=s3_bucket, Key=f"models/{rel}", Body=data)
    slow = _hold_back_reads(fault_proxy)
    with fleet_of(
        tmp_path,
        3,
        catalog_url=private_pg.url(private_pg.create_database()),
        endpoint=moto_endpoint,
        bucket=s3_bucket,
        endpoints={2: fault_proxy.url},
        settings={"fleet_poll_interval_s": 0.1, "fleet_claim_ttl_s": 2.0},
    ) as three:
        for p in three:  # each host has read the records of the model before the outage
            for rel, data in MODEL.items():
                assert _content(p, rel) == data
        with three[0].client() as c:
            ids = {
                rel: c.get("/v1/files/lookup", params={"path": rel}).json()["id"] for rel in MODEL
            }
        with three[0].client() as c:
            r = c.post("/v1/fleet/prefetch", json={"model": "llm", "target": "nvme"})
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]
            wait_for(
                lambda: any(
                    t["host"] == "host-2" and t["state"] == "running"
                    for t in c.get(f"/v1/fleet/jobs/{job_id}").json()["hosts"]
                ),
                what="host 2 at work",
            )
        private_pg.halt()
        try:
            for p in three:
                with p.client() as c:
                    for rel, data in MODEL.items():
                        r = c.get(f"/v1/files/{ids[rel]}/content")
                        assert r.status_code == 200, r.text
                        assert r.content == data
                    ready = c.get("/readyz").json()
                    assert ready["status"] == "degraded", ready
        finally:
            slow.clear()
            private_pg.resume()
        with three[1].client() as c:
            doc = _finished(c, job_id)
        assert doc["state"] == "done", json.dumps(doc["hosts"])
        assert all(t["errors"] == [] for t in doc["hosts"]), doc["hosts"]
        for p in three:
            _check_local_copies(p)
