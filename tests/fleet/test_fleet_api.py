"""The fleet routes on two real tierd servers (uvicorn on loopback) with their own host ids and
data directories, sharing one PostgreSQL catalog and one bucket (moto): each lists the other,
each locates files and models on both, and a bad query is a JSON 4xx that changes nothing."""

from __future__ import annotations

import json
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

MiB = 1 << 20
MODEL = {
    "llm/model.safetensors": save({"w": np.arange(4096, dtype=np.float32)}),
    "llm/config.json": json.dumps({"hidden_size": 64}).encode(),
}


def _settings(root: Path, host: str, pg_url: str, endpoint: str, bucket: str) -> Any:
    return make_settings(
        root,
        host_id=host,
        catalog_url=pg_url,
        heartbeat_interval_s=0.1,
        watch=False,
        tiers=[
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


def _places(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(p["host_id"], p["kind"], p["location"]) for p in doc["places"]]


def test_two_hosts_see_each_other_and_locate_files_and_models(
    fleet: tuple[httpx.Client, httpx.Client],
    pg_url: str,
    tmp_path: Path,
    s3_client: Any,
    s3_bucket: str,
) -> None:
    ca, cb = fleet
    for c in (ca, cb):
        r = c.get("/v1/fleet/hosts")
        assert r.status_code == 200, r.text
        hosts = {h["host_id"]: h for h in r.json()["items"]}
        assert set(hosts) == {"host-a", "host-b"}
        assert {h["state"] for h in hosts.values()} == {"up"}
        assert [(t["name"], t["shared"]) for t in hosts["host-a"]["tiers"]] == [
            ("nvme", False),
            ("s3", True),
        ]
    assert ca.get("/v1/fleet/hosts").json()["this_host"] == "host-a"

    # Both adopted the bucket's files: each is in the bucket for both hosts.
    r = cb.get("/v1/fleet/locate", params={"path": "llm/model.safetensors"})
    assert r.status_code == 200, r.text
    [doc] = r.json()["files"]
    assert (doc["tier"], doc["host"]) == ("s3", None)
    assert _places(doc) == [("host-a", "object_store", "s3"), ("host-b", "object_store", "s3")]

    # Prefetched to host A's nvme: the bucket is the fleet's origin, so A keeps a *copy* on its
    # nvme, and the object stays where it is: B still has it in the bucket.
    fid = doc["id"]
    r = ca.post("/v1/prefetch", json={"file_ids": [fid], "target": "nvme"})
    assert r.status_code == 202, r.text
    job = wait_for(
        lambda: (j := ca.get(f"/v1/jobs/{r.json()['id']}").json())["state"] != "running" and j,
        what="the prefetch",
    )
    assert (job["state"], job["errors"]) == ("done", []), job
    s3_client.head_object(Bucket=s3_bucket, Key="models/llm/model.safetensors")
    copies = list((tmp_path / "a" / "nvme" / ".tierd-copies").iterdir())
    assert [p.read_bytes() for p in copies] == [MODEL["llm/model.safetensors"]]
    for c in (ca, cb):
        [doc] = c.get("/v1/fleet/locate", params={"path": "llm/model.safetensors"}).json()["files"]
        assert (doc["tier"], doc["host"]) == ("s3", None)
        assert _places(doc) == [
            ("host-a", "copy", "nvme"),
            ("host-a", "object_store", "s3"),
            ("host-b", "object_store", "s3"),
        ]
    # A loads from its copy (a local read on nvme), B from the bucket; the bytes are the same.
    for c, tier, sources in (
        (ca, "nvme", {"page_cache", "storage"}),
        (cb, "s3", {"object_store"}),
    ):
        r = c.post("/v1/load", json={"path": "llm/model.safetensors", "device": "cpu"})
        assert r.status_code == 200, r.text
        assert (r.json()["tier"], r.json()["source"] in sources) == (tier, True), r.json()
        assert c.delete(f"/v1/buffers/{r.json()['buffer_id']}").status_code in (200, 204)
    assert ca.get(f"/v1/files/{fid}/content").content == MODEL["llm/model.safetensors"]
    # A manual move off the origin is refused (it would take the file from host B), and
    # changes nothing.
    r = ca.post("/v1/migrations", params={"wait": "true"}, json={"file_id": fid, "to_tier": "nvme"})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "conflict"
    assert cb.get(f"/v1/files/{fid}").json()["tier"] == "s3"
    # The copy is not a file of A's nvme: A's scan adopts nothing from the copies directory.
    scanned = ca.post("/v1/scan").json()
    assert (scanned["adopted"], scanned["skipped"]) == ([], []), scanned
    assert cb.post("/v1/scan").json()["missing"] == []
    assert cb.get(f"/v1/files/{fid}").json()["state"] == "stable"

    # A model is located file by file, with a summary per host.
    r = cb.get("/v1/fleet/locate", params={"model": "llm"})
    assert r.status_code == 200, r.text
    out = r.json()
    files = {f["path"]: f for f in out["files"]}
    assert set(files) == set(MODEL)
    assert _places(files["llm/config.json"]) == [
        ("host-a", "object_store", "s3"),
        ("host-b", "object_store", "s3"),
    ]
    assert _places(files["llm/model.safetensors"])[0] == ("host-a", "copy", "nvme")
    summary = {h["host_id"]: h for h in out["hosts"]}
    assert (summary["host-a"]["complete"], summary["host-a"]["files"]) == (True, 2)
    assert out["hosts"][0]["host_id"] == "host-a"

    # A load on A leases shared memory; A's heartbeat reports it to the fleet.
    r = ca.post("/v1/load", json={"path": "llm/config.json", "device": "cpu"})
    assert r.status_code == 200, r.text
    size = len(MODEL["llm/config.json"])
    wait_for(
        lambda: (
            {h["host_id"]: h for h in cb.get("/v1/fleet/hosts").json()["items"]}["host-a"][
                "cpu_leased_bytes"
            ]
            >= size
        ),
        what="host A's leased bytes in the fleet view",
    )
    assert ca.delete(f"/v1/buffers/{r.json()['buffer_id']}").status_code in (200, 204)
    # Both hosts' rows are in the one catalog.
    assert [h for (h,) in run_sql(pg_url, "SELECT host_id FROM hosts ORDER BY 1")] == [
        "host-a",
        "host-b",
    ]


BAD = [
    ({}, 422, "invalid_query"),
    ({"path": "llm/config.json", "model": "llm"}, 422, "invalid_query"),
    ({"path": "../etc/passwd"}, 422, "invalid_path"),
    ({"model": "/abs"}, 422, "invalid_path"),
    ({"path": ""}, 422, None),
    ({"path": "llm/nope.bin"}, 404, None),
    ({"model": "nope"}, 404, None),
    ({"model": "llm/config.json"}, 404, None),  # a file, not a model
]


def test_a_bad_locate_is_a_json_4xx_and_changes_nothing(
    fleet: tuple[httpx.Client, httpx.Client], tmp_path: Path, pg_url: str
) -> None:
    ca, _ = fleet
    files = "SELECT id, relpath, tier, host, state, generation, access_count FROM files ORDER BY id"
    before = run_sql(pg_url, files), disk_snapshot(tmp_path / "a"), disk_snapshot(tmp_path / "b")
    for params, status, code in BAD:
        r = ca.get("/v1/fleet/locate", params=params)
        assert r.status_code == status, (params, r.text)
        err = r.json()["error"]
        assert err["message"] and (code is None or err["code"] == code), (params, err)
    after = run_sql(pg_url, files), disk_snapshot(tmp_path / "a"), disk_snapshot(tmp_path / "b")
    assert after == before
