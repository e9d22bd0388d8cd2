"""A fleet without ``fleet_token`` says so (issue 42): hosts sharing a PostgreSQL catalog and a
bucket tier, with no token, each read the bucket themselves; start-up warns, ``/readyz`` is
degraded with the reason, ``/metrics`` shows it. With the token, or on SQLite, nothing is said."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LiveServer, make_settings
from tests.s3 import REGION


def _settings(tmp_path: Path, pg_url: str | None, endpoint: str, bucket: str, **kw: Any) -> Any:
    tiers = [
        {"name": "nvme", "path": str(tmp_path / "data" / "nvme")},
        {
            "name": "s3",
            "kind": "object",
            "url": f"s3://{bucket}/fleet",
            "endpoint_url": endpoint,
            "region": REGION,
        },
    ]
    if pg_url is not None:
        kw["catalog_url"] = pg_url
    return make_settings(tmp_path / "data", tiers=tiers, watch=False, **kw)


def _said(srv: LiveServer) -> tuple[dict[str, Any], str]:
    with httpx.Client(base_url=srv.url) as http:
        return http.get("/readyz").json(), http.get("/metrics").text


def test_a_shared_catalog_and_bucket_without_a_fleet_token_says_peers_are_off(
    tmp_path: Path,
    pg_url: str,
    moto_endpoint: str,
    s3_bucket: str,
    s3_env: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with (
        caplog.at_level(logging.WARNING),
        LiveServer(_settings(tmp_path, pg_url, moto_endpoint, s3_bucket)) as srv,
    ):
        ready, metrics = _said(srv)
    assert ready["status"] == "degraded" and ready["checks"]["fleet"]["peers"] is False
    (fleet,) = [d for d in ready["degraded"] if d["component"] == "fleet"]
    assert "fleet_token" in fleet["reason"] and "s3" in fleet["reason"]
    assert re.search(r"^tierd_fleet_peers_off 1\.0$", metrics, re.M)
    assert "peers are off" in caplog.text


@pytest.mark.parametrize("case", ["token", "sqlite"])
def test_peers_on_or_one_host_says_nothing(
    tmp_path: Path, pg_url: str, moto_endpoint: str, s3_bucket: str, s3_env: Any, case: str
) -> None:
    kw: dict[str, Any] = {"fleet_token": "f" * 32} if case == "token" else {}
    url = pg_url if case == "token" else None
    with LiveServer(_settings(tmp_path, url, moto_endpoint, s3_bucket, **kw)) as srv:
        ready, metrics = _said(srv)
    assert ready["checks"]["fleet"] == {"peers": True, "reason": None}
    assert not [d for d in ready["degraded"] if d["component"] == "fleet"]
    assert re.search(r"^tierd_fleet_peers_off 0\.0$", metrics, re.M)
