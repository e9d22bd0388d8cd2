"""``GET /v1/fleet/heat`` on two real tierd servers (uvicorn on loopback) with their own host
ids and data directories, sharing one PostgreSQL catalog and one bucket (moto): reads on each
host show up as that host's heat and in the fleet's, the policy's ``promotion_heat`` picks the
heat that decides, and a bad query is a JSON 4xx that changes nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.catalog.conftest import run_sql
from tests.conftest import disk_snapshot, wait_for
from tests.fleet.procs import live_pair
from tests.fleet.test_fleet_api import _settings

FILES = {
    "llm/model.safetensors": b"\0" * 4096,
    "llm/config.json": json.dumps({"hidden_size": 64}).encode(),
}


@pytest.fixture
def fleet(
    tmp_path: Path, pg_url: str, moto_endpoint: str, s3_bucket: str, s3_client: Any, s3_env: Any
) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    def settings_of(root: Path, host: str) -> Any:
        return _settings(root, host, pg_url, moto_endpoint, s3_bucket)

    with live_pair(tmp_path, FILES, s3_client, s3_bucket, settings_of) as pair:
        yield pair


def _read(c: httpx.Client, fid: int, times: int) -> None:
    for _ in range(times):
        r = c.get(f"/v1/files/{fid}/content")
        assert r.status_code == 200, r.text


def _heat(c: httpx.Client, **params: str) -> dict[str, Any]:
    r = c.get("/v1/fleet/heat", params=params)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_each_hosts_reads_are_its_heat_and_the_fleets(
    fleet: tuple[httpx.Client, httpx.Client],
) -> None:
    ca, cb = fleet
    path = "llm/model.safetensors"
    [doc] = _heat(ca, path=path)["files"]
    assert (doc["tier"], doc["host"], doc["fleet_heat"], doc["hosts"]) == ("s3", None, 0.0, {})
    fid = doc["id"]
    _read(ca, fid, 3)
    _read(cb, fid, 1)

    def counted() -> bool:
        [d] = _heat(cb, path=path)["files"]
        return {h: v["access_count"] for h, v in d["hosts"].items()} == {
            "host-a": 3,
            "host-b": 1,
        }

    wait_for(counted, what="both hosts' reads in the fleet heat")
    out = _heat(cb, path=path)
    assert (out["this_host"], out["promotion_heat"], out["path"]) == ("host-b", "local", path)
    [doc] = out["files"]
    assert list(doc["hosts"]) == ["host-a", "host-b"]  # hottest first
    assert doc["access_count"] == 4
    a, b = doc["hosts"]["host-a"]["heat"], doc["hosts"]["host-b"]["heat"]
    assert 2.9 < a <= 3 and 0.9 < b <= 1
    assert doc["fleet_heat"] == pytest.approx(a + b, abs=1e-3)
    # On host b, under the default policy, b's own heat decides; under "fleet", the sum.
    assert doc["local_heat"] == doc["deciding_heat"] == b
    policy = cb.get("/v1/policy").json()["policy"]
    r = cb.put("/v1/policy", json=policy | {"promotion_heat": "fleet"})
    assert r.status_code == 200, r.text
    [doc] = (out := _heat(cb, path=path))["files"]
    assert out["promotion_heat"] == "fleet"
    assert doc["deciding_heat"] == pytest.approx(doc["fleet_heat"], abs=1e-3)
    assert doc["local_heat"] == pytest.approx(b, abs=1e-3)

    # A model: each of its files; the one never read has no host's heat.
    files = {f["path"]: f for f in _heat(ca, model="llm")["files"]}
    assert set(files) == set(FILES)
    assert files["llm/config.json"]["hosts"] == {}
    assert files["llm/config.json"]["local_heat"] == 0.0
    assert files[path]["local_heat"] == pytest.approx(a, abs=1e-3)


BAD = [
    ({}, 422, "invalid_query"),
    ({"path": "llm/config.json", "model": "llm"}, 422, "invalid_query"),
    ({"path": "../etc/passwd"}, 422, "invalid_path"),
    ({"model": "/abs"}, 422, "invalid_path"),
    ({"path": ""}, 422, None),
    ({"path": "x" * 20_000}, 422, None),
    ({"path": "llm/nope.bin"}, 404, "file_not_found"),
    ({"model": "nope"}, 404, None),
    ({"model": "llm/config.json"}, 404, None),  # a file, not a model
]


def test_a_bad_fleet_heat_query_is_a_json_4xx_and_changes_nothing(
    fleet: tuple[httpx.Client, httpx.Client], tmp_path: Path, pg_url: str
) -> None:
    ca, _ = fleet
    files = "SELECT id, relpath, tier, host, state, generation, access_count, heat FROM files"
    rows = "SELECT file_id, host, heat, access_count FROM host_heat"

    def state() -> tuple[object, ...]:
        return (
            sorted(run_sql(pg_url, files)),
            sorted(run_sql(pg_url, rows)),
            disk_snapshot(tmp_path / "a"),
            disk_snapshot(tmp_path / "b"),
        )

    [doc] = _heat(ca, path="llm/config.json")["files"]
    _read(ca, doc["id"], 1)
    wait_for(lambda: run_sql(pg_url, rows) != [], what="host a's row")
    before = state()
    for params, status, code in BAD:
        r = ca.get("/v1/fleet/heat", params=params)
        assert r.status_code == status, (params, r.text)
        err = r.json()["error"]
        assert err["message"] and (code is None or err["code"] == code), (params, err)
    # A good query reads too, and counts as no access either.
    assert _heat(ca, model="llm")["files"]
    assert state() == before
