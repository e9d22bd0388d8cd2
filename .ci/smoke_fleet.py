"""The fleet compose's checks (see .ci/compose-smoke): the bucket made, both hosts ready, a file
uploaded to the shared tier through one host, a fleet prefetch to both hosts' nvme tier, a
copy on each host's nvme as the catalog locates them, and the bytes read back on each host,
compared with what was uploaded."""

from __future__ import annotations

import os
import sys
import time

import boto3
import httpx

from tiering.checksum import Hasher

PATH = "m/weights.bin"
NVME = ("copy", "nvme")


def _sum(data: bytes) -> str:
    h = Hasher()
    h.update(data)
    return h.value()


def _wait(what: str, check: object, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"fleet: {what} did not happen in {timeout:g} s")
        time.sleep(0.5)


def bucket(s3: str) -> None:
    c = boto3.client(
        "s3",
        endpoint_url=s3,
        region_name="us-east-1",
        aws_access_key_id="tierd",
        aws_secret_access_key="tierd-secret",
    )
    _wait("the store answering", lambda: c.list_buckets() is not None, 60)
    c.create_bucket(Bucket="tierd-fleet")


def check(a: str, b: str, token: str) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    with (
        httpx.Client(base_url=a, headers=auth, timeout=60) as ha,
        httpx.Client(base_url=b, headers=auth, timeout=60) as hb,
    ):
        for h in (ha, hb):
            _wait(f"{h.base_url} ready", lambda h=h: h.get("/readyz").status_code == 200)
        _wait("both hosts registered", lambda: len(ha.get("/v1/fleet/hosts").json()["items"]) == 2)
        data = os.urandom(16 << 20)
        r = ha.put(
            "/v1/files/content",
            params={"path": PATH, "tier": "s3", "checksum": _sum(data)},
            content=data,
        )
        if r.status_code != 201:
            raise SystemExit(f"fleet: upload to the bucket: {r.status_code} {r.text}")
        r = ha.post("/v1/fleet/prefetch", json={"paths": [PATH], "target": "nvme"})
        if r.status_code != 202:
            raise SystemExit(f"fleet: prefetch: {r.status_code} {r.text}")
        job = r.json()["id"]
        _wait(
            "the fleet prefetch done on both hosts",
            lambda: ha.get(f"/v1/fleet/jobs/{job}").json()["state"] in ("done", "failed"),
        )
        state = ha.get(f"/v1/fleet/jobs/{job}").json()
        if state["state"] != "done" or len(state["hosts"]) != 2:
            raise SystemExit(f"fleet: the prefetch ended {state}")
        # Each host keeps a copy on its own nvme tier (the catalog says so), and reads the bytes
        # that were uploaded.
        (located,) = ha.get("/v1/fleet/locate", params={"path": PATH}).json()["files"]
        copies = {p["host_id"] for p in located["places"] if (p["kind"], p["location"]) == NVME}
        if copies != {"tierd-a", "tierd-b"}:
            raise SystemExit(f"fleet: nvme copies on {sorted(copies)}: {located['places']}")
        for h in (ha, hb):
            fid = h.get("/v1/files/lookup", params={"path": PATH}).json()["id"]
            if _sum(h.get(f"/v1/files/{fid}/content").content) != _sum(data):
                raise SystemExit(f"fleet: {h.base_url} reads other bytes")


if __name__ == "__main__":
    if sys.argv[1] == "bucket":
        bucket(sys.argv[2])
    else:
        check(*sys.argv[2:5])
