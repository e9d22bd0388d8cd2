"""A bucket that lists in any order, lists keys outside the prefix, or fails to list
(RELIABILITY.md row 33): the tier walks in relpath order, skips what is not its own, and a
failing listing leaves the tier's files as they are while every other tier serves."""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LiveServer, make_settings
from tests.s3 import REGION
from tests.s3_faults import FaultProxy, Rule
from tiering.tiers import WalkEntry
from tiering.tiers._listing import in_relpath_order

Make = Callable[..., Any]
KEYS = ["b/2.bin", "a/1.bin", "c/3.bin", "a/0.bin", "b/1.bin"]
_CONTENTS = re.compile(rb"<Contents>.*?</Contents>", re.S)


def _shuffle_listing(status: int, headers: Any, body: bytes) -> tuple[int, Any, bytes]:
    """A store that lists in no particular order (S3 Express directory buckets, some
    S3-compatible stores): the page's keys reversed."""
    items = _CONTENTS.findall(body)
    if len(items) < 2:
        return status, headers, body
    head, tail = body.split(items[0], 1)[0], body.rsplit(items[-1], 1)[1]
    body = head + b"".join(reversed(items)) + tail
    return status, [(k, v) for k, v in headers if k.lower() != "content-length"], body


def _foreign_key(status: int, headers: Any, body: bytes) -> tuple[int, Any, bytes]:
    """A store that ignored ``Prefix``: a key of someone else's listed too."""
    items = _CONTENTS.findall(body)
    if not items:
        return status, headers, body
    other = re.sub(rb"<Key>[^<]*</Key>", b"<Key>elsewhere/secret.bin</Key>", items[0])
    body = body.replace(items[0], items[0] + other, 1)
    return status, [(k, v) for k, v in headers if k.lower() != "content-length"], body


def _listing(proxy: FaultProxy, edit: Callable[..., Any]) -> None:
    with proxy.state.lock:
        proxy.state.rules.append(
            Rule("edit", method="GET", query="list-type=2", times=1 << 30, edit=edit)
        )


def _put_keys(s3_client: Any, bucket: str) -> None:
    for key in KEYS:
        s3_client.put_object(Bucket=bucket, Key=f"pre/{key}", Body=key.encode())


def test_an_unordered_listing_is_walked_in_relpath_order(
    make_object_tier: Make, fault_proxy: FaultProxy, s3_client: Any, s3_bucket: str
) -> None:
    _put_keys(s3_client, s3_bucket)
    _listing(fault_proxy, _shuffle_listing)
    tier = make_object_tier("s3", endpoint_url=fault_proxy.url)
    assert [e.relpath for e in tier.walk()] == sorted(KEYS)


def test_keys_outside_the_prefix_are_skipped(
    make_object_tier: Make,
    fault_proxy: FaultProxy,
    s3_client: Any,
    s3_bucket: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _put_keys(s3_client, s3_bucket)
    _listing(fault_proxy, _foreign_key)
    tier = make_object_tier("s3", endpoint_url=fault_proxy.url)
    with caplog.at_level(logging.WARNING):
        assert [e.relpath for e in tier.walk()] == sorted(KEYS)
    assert "'elsewhere/secret.bin'" in caplog.text and "not under its prefix" in caplog.text


def test_a_long_listing_is_sorted_in_bounded_memory() -> None:
    names = [f"d{i % 7}/f{i:05d}" for i in range(2_000)]
    random.Random(33).shuffle(names)
    entries = (WalkEntry(n, i, i) for i, n in enumerate(names))
    walked = list(in_relpath_order(entries, run=128))  # 16 runs spilled to temp files
    assert [e.relpath for e in walked] == sorted(names)
    assert {e.relpath: e.size for e in walked} == {n: i for i, n in enumerate(names)}


def test_a_failing_listing_never_stops_start_up(
    tmp_path: Path, fault_proxy: FaultProxy, s3_client: Any, s3_bucket: str, s3_env: Any
) -> None:
    _put_keys(s3_client, s3_bucket)
    tiers = [
        {"name": "nvme", "path": str(tmp_path / "data" / "nvme")},
        {
            "name": "s3",
            "kind": "object",
            "url": f"s3://{s3_bucket}/pre",
            "endpoint_url": fault_proxy.url,
            "region": REGION,
        },
    ]
    settings = make_settings(tmp_path / "data", tiers=tiers, watch=False)
    (tmp_path / "data" / "nvme").mkdir(parents=True)
    (tmp_path / "data" / "nvme" / "local.bin").write_bytes(b"local bytes")
    # The first start adopts the bucket's objects; then the bucket's listings fail.
    with LiveServer(settings) as srv, httpx.Client(base_url=srv.url) as http:
        assert len(http.get("/v1/files", params={"limit": 100}).json()["items"]) == len(KEYS) + 1
    rule = fault_proxy.fail("500", method="GET", query="list-type=2", times=1 << 30)
    with LiveServer(settings) as srv, httpx.Client(base_url=srv.url) as http:
        ready = http.get("/readyz").json()
        assert ready["status"] == "degraded", ready
        (down,) = [d for d in ready["degraded"] if d["component"] == "tier:s3"]
        assert "does not answer" in down["reason"]
        assert ready["checks"]["last_scan"]["failed"] == 1
        files = http.get("/v1/files", params={"limit": 100}).json()["items"]
        assert {f["state"] for f in files} == {"stable"}  # nothing marked missing
        local = http.get("/v1/files/lookup", params={"path": "local.bin"}).json()
        assert http.get(f"/v1/files/{local['id']}/content").content == b"local bytes"
    assert rule.fired >= 1
