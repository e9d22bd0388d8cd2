"""Memory fills of many hosts at once go through the fleet's piece exchange (issue 42): three
real tierd processes on one PostgreSQL catalog, the bucket (moto) behind a proxy that is its own
account of what it sent. One fleet prefetch puts a shared file into every host's memory tier at
once; each host's fill makes its copy on disk from pieces its peers relay, so the bucket sends
the file about once, not three times, and every host ends with a verified copy in memory. A
host with no tier that can hold copies reads the bucket as before, and says so once."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import LiveServer, make_settings, wait_for
from tests.fleet.procs import TierdProcess, fleet_of, object_tier
from tests.s3_faults import FaultProxy
from tierd_client import Client

TOKEN = "fleet-memory-fills-credential"
MiB = 1 << 20
PATH = "llm/weights.bin"
DATA = os.urandom(20 * MiB + 7)  # three 8 MiB pieces, the last short
SIZE = len(DATA)


@pytest.fixture
def origin(
    fault_proxy: FaultProxy, s3_client: Any, s3_bucket: str, s3_env: Any
) -> Iterator[FaultProxy]:
    s3_client.put_object(Bucket=s3_bucket, Key=f"models/{PATH}", Body=DATA)
    yield fault_proxy


def _origin_bytes(proxy: FaultProxy, bucket: str) -> int:
    """What the bucket sent of the model's objects, by its own account."""
    return sum(n for path, n in proxy.sent.items() if path.startswith(f"/{bucket}/models/"))


def _fleet_prefetch(p: TierdProcess, hosts: list[str]) -> dict[str, Any]:
    with p.client() as c:
        body = {"paths": [PATH], "hosts": hosts, "target": "memory"}
        r = c.post("/v1/fleet/prefetch", json=body)
        assert r.status_code == 202, r.text

        def done() -> dict[str, Any] | None:
            doc: dict[str, Any] = c.get(f"/v1/fleet/jobs/{r.json()['id']}").json()
            return doc if doc["state"] not in ("queued", "running") else None

        doc: dict[str, Any] = wait_for(done, timeout=120, what="the fleet prefetch")
    assert doc["state"] == "done", doc
    return doc


def _load(url: str, http: httpx.Client, path: str = PATH) -> tuple[str, bytes]:
    """Load ``path`` into host memory: the lease's source and its bytes."""
    r = http.post("/v1/load", json={"path": path, "device": "cpu"})
    assert r.status_code == 200, r.text
    lease = r.json()
    with Client(url) as api, api.open_buffer(lease["buffer_id"]) as buf:
        data = np.asarray(buf).tobytes()  # the buffer is released as the block ends
    return lease["source"], data


def test_three_hosts_fill_their_memory_at_once_and_the_bucket_sends_the_file_about_once(
    tmp_path: Path, pg_url: str, origin: FaultProxy, s3_bucket: str
) -> None:
    with fleet_of(
        tmp_path, 3, catalog_url=pg_url, endpoint=origin.url, bucket=s3_bucket,
        settings={"fleet_token": TOKEN, "fleet_poll_interval_s": 0.1, "host_timeout_s": 5.0,
                  "memory_floor_bytes": 0},
        memory_bytes=32 * MiB,
    ) as hosts:  # fmt: skip
        doc = _fleet_prefetch(hosts[0], [p.host_id for p in hosts])
        sent = _origin_bytes(origin, s3_bucket)
        assert sent <= 1.3 * SIZE, f"the bucket sent {sent / SIZE:.2f}x the file"
        # Each host's task says where its bytes came from: they add up to the file, the
        # bucket's share about once in all, and peers gave the rest.
        sources = {t["host"]: t["sources"] for t in doc["hosts"]}
        assert all(sum(s.values()) == SIZE for s in sources.values()), sources
        assert sum(s.get("bucket", 0) for s in sources.values()) <= 1.3 * SIZE, sources
        assert any(k.startswith("peer:") for s in sources.values() for k in s), sources
        # Every host's memory holds the bucket's bytes (checked against the catalog's
        # checksum as it was filled), and serves loads from there.
        for p in hosts:
            with p.client() as c:
                assert _load(p.url, c) == ("memory", DATA)


def test_a_host_that_cannot_hold_copies_fills_memory_from_the_bucket_and_says_why_once(
    tmp_path: Path,
    pg_url: str,
    moto_endpoint: str,
    s3_client: Any,
    s3_bucket: str,
    s3_env: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    small = {"a.bin": os.urandom(MiB + 1), "b.bin": os.urandom(5000)}
    for rel, body in small.items():
        s3_client.put_object(Bucket=s3_bucket, Key=f"models/{rel}", Body=body)
    tiers = [
        {"name": "ram", "kind": "memory", "quota_bytes": 4 * MiB},
        object_tier(moto_endpoint, s3_bucket),  # no directory tier: nowhere to keep a copy
    ]
    settings = make_settings(
        tmp_path, tiers=tiers, watch=False, catalog_url=pg_url, host_id="host-m",
        fleet_token=TOKEN, memory_floor_bytes=0,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING), LiveServer(settings) as srv, srv.client() as c:
        r = c.post("/v1/prefetch", json={"paths": list(small), "target": "memory"})
        assert r.status_code == 202, r.text

        def done() -> dict[str, Any] | None:
            doc: dict[str, Any] = c.get(f"/v1/jobs/{r.json()['id']}").json()
            return doc if doc["state"] not in ("queued", "running") else None

        job = wait_for(done, timeout=60, what="the prefetch")
        assert job["state"] == "done", job
        for rel, body in small.items():
            assert _load(srv.url, c, rel) == ("memory", body)
    said = [m for m in caplog.messages if "no tier that can hold copies" in m]
    assert len(said) == 1, said
