"""The policy, plan, migration and pin routes through the real app, and the issue's done-when:
files read through the API move up on the next scheduler pass and drift down once cold."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from tests.conftest import disk_snapshot, wait_for
from tests.helpers import engine_settings, payload

ADMIN, DATA = "admin-secret", "data-secret"


@pytest.fixture
def api(tmp_path: Path) -> Iterator[TestClient]:
    settings = engine_settings(tmp_path / "data", admin_token=ADMIN, data_token=DATA)
    with TestClient(create_app(settings), base_url="http://127.0.0.1") as c:
        c.headers["Authorization"] = f"Bearer {ADMIN}"
        yield c


def upload(c: TestClient, path: str, data: bytes, tier: str = "nvme") -> dict[str, Any]:
    r = c.put("/v1/files/content", params={"path": path, "tier": tier}, content=data)
    assert r.status_code == 201, r.text
    return r.json()


def test_policy_get_put_and_precise_422(api: TestClient, tmp_path: Path) -> None:
    r = api.get("/v1/policy", headers={"Authorization": f"Bearer {DATA}"})
    assert r.status_code == 200
    body = r.json()
    assert body["version"] == 0
    assert body["policy"]["tiers"]["nvme"]["min_heat"] == 100
    doc = body["policy"] | {"hysteresis": 0.1}
    r = api.put("/v1/policy", json=doc)
    assert r.status_code == 200 and r.json()["version"] == 1 and r.json()["author"] == "admin"
    assert api.get("/v1/policy").json()["policy"]["hysteresis"] == 0.1
    before = disk_snapshot(tmp_path / "data")
    for bad, part in [
        (
            doc
            | {"tiers": {"nvme": {"min_heat": 1}, "ssd": {"min_heat": 5}, "hdd": {"min_heat": 0}}},
            "tiers.ssd.min_heat: must be below nvme's min_heat (1)",
        ),
        (doc | {"concurrency": 0}, "concurrency: Input should be greater than or equal to 1"),
        (doc | {"surprise": True}, "surprise: unknown field"),
        ([1, 2], "must be a JSON object"),
    ]:
        r = api.put("/v1/policy", json=bad)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "invalid_policy"
        assert part in r.json()["error"]["message"]
    assert api.get("/v1/policy").json()["version"] == 1
    assert (
        api.put(
            "/v1/policy", content=b"{not json", headers={"content-type": "application/json"}
        ).status_code
        == 422
    )
    # Roles: the data token reads, only the admin token writes.
    assert (
        api.put("/v1/policy", json=doc, headers={"Authorization": f"Bearer {DATA}"}).status_code
        == 403
    )
    assert api.put("/v1/policy", json=doc, headers={"Authorization": ""}).status_code == 401
    assert disk_snapshot(tmp_path / "data") == before


def test_plan_explains_every_move(api: TestClient) -> None:
    f = upload(api, "cold.bin", b"c" * 1000)
    doc = api.get("/v1/policy").json()["policy"] | {"min_age_s": 0}
    r = api.post("/v1/policy/plan")
    assert r.status_code == 200 and r.json()["moves"] == []  # too young under the default
    r = api.post("/v1/policy/plan", json=doc)  # a draft: nothing stored
    assert r.status_code == 200
    body = r.json()
    assert body["policy_version"] is None
    [m] = body["moves"]
    assert (m["file_id"], m["from_tier"], m["to_tier"], m["kind"]) == (
        f["id"],
        "nvme",
        "hdd",
        "demote",
    )
    assert m["reason"] == "heat 0.0 < 100.0 (-20% hysteresis): demote nvme → hdd"
    assert api.get("/v1/policy").json()["version"] == 0
    r = api.post("/v1/policy/plan", json={"tiers": {}})
    assert r.status_code == 422 and "missing rules" in r.json()["error"]["message"]
    assert (
        api.post("/v1/policy/plan", headers={"Authorization": f"Bearer {DATA}"}).status_code == 403
    )


def test_manual_moves_and_listing(api: TestClient, tmp_path: Path) -> None:
    data = payload(200_000)
    f = upload(api, "m/a.bin", data)
    r = api.post(
        "/v1/migrations", json={"file_id": f["id"], "to_tier": "hdd"}, params={"wait": True}
    )
    assert r.status_code == 200, r.text
    [m] = r.json()["migrations"]
    assert (m["state"], m["from_tier"], m["to_tier"], m["bytes_copied"]) == (
        "done",
        "nvme",
        "hdd",
        len(data),
    )
    assert m["duration_s"] is not None and m["error"] is None and not m["in_flight"]
    assert api.get(f"/v1/files/{f['id']}").json()["tier"] == "hdd"
    assert api.get(f"/v1/files/{f['id']}/content").content == data
    # Without wait: 202, and it completes on the scheduler's workers.
    r = api.post("/v1/migrations", json={"file_id": f["id"], "to_tier": "ssd"})
    assert r.status_code == 202
    wait_for(lambda: api.get(f"/v1/files/{f['id']}").json()["tier"] == "ssd", what="move to ssd")
    listing = api.get("/v1/migrations", headers={"Authorization": f"Bearer {DATA}"}).json()
    assert [i["to_tier"] for i in listing["items"]] == ["ssd", "hdd"]  # newest first
    page = api.get("/v1/migrations", params={"limit": 1}).json()
    assert len(page["items"]) == 1 and page["next_cursor"]
    rest = api.get("/v1/migrations", params={"limit": 1, "cursor": page["next_cursor"]}).json()
    assert rest["items"][0]["to_tier"] == "hdd" and rest["next_cursor"] is None
    assert api.get("/v1/migrations", params={"state": "in_flight"}).json()["items"] == []
    assert (
        len(api.get("/v1/migrations", params={"state": "done", "file_id": f["id"]}).json()["items"])
        == 2
    )

    # Bad input: 4xx, nothing changed on disk or in the catalog.
    before = disk_snapshot(tmp_path / "data")
    history = api.get("/v1/migrations").json()
    for body, status, code in [
        ({"file_id": f["id"], "to_tier": "tape"}, 404, "tier_not_found"),
        ({"file_id": 9999, "to_tier": "hdd"}, 404, "file_not_found"),
        ({"file_id": f["id"], "to_tier": "ssd"}, 409, "conflict"),
        ({"file_id": f["id"]}, 422, "invalid_request"),
        ({"file_id": "x", "to_tier": "hdd"}, 422, "invalid_request"),
        ({"file_id": f["id"], "to_tier": "hdd", "extra": 1}, 422, "invalid_request"),
    ]:
        r = api.post("/v1/migrations", json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), (body, r.text)
    assert api.get("/v1/migrations", params={"state": "bogus"}).status_code == 422
    assert api.get("/v1/migrations", params={"cursor": "zzz"}).status_code == 422
    assert (
        api.post("/v1/migrations", json={}, headers={"Authorization": f"Bearer {DATA}"}).status_code
        == 403
    )
    assert disk_snapshot(tmp_path / "data") == before
    assert api.get("/v1/migrations").json() == history


def test_pins(api: TestClient, tmp_path: Path) -> None:
    # The scheduler would act on the pin at once; here the test runs the plan itself.
    doc = api.get("/v1/policy").json()["policy"] | {"enabled": False}
    assert api.put("/v1/policy", json=doc).status_code == 200
    f = upload(api, "p.bin", b"p" * 5000, tier="ssd")
    r = api.post(f"/v1/files/{f['id']}/pin")
    assert r.status_code == 200 and r.json()["pinned_tier"] == "ssd"
    r = api.post("/v1/migrations", json={"file_id": f["id"], "to_tier": "hdd"})
    assert r.status_code == 409 and "pinned to ssd" in r.json()["error"]["message"]
    r = api.post(f"/v1/files/{f['id']}/pin", json={"tier": "nvme"})
    assert r.json()["pinned_tier"] == "nvme"
    # The plan brings a file pinned elsewhere to its pin, whatever its heat.
    plan = api.post("/v1/policy/plan").json()["moves"]
    assert [(m["file_id"], m["to_tier"], m["kind"]) for m in plan] == [(f["id"], "nvme", "pin")]
    r = api.post("/v1/migrations", params={"wait": True})
    assert r.status_code == 200 and r.json()["planned"] == 1
    assert api.get(f"/v1/files/{f['id']}").json()["tier"] == "nvme"
    before = disk_snapshot(tmp_path / "data")
    assert api.post(f"/v1/files/{f['id']}/pin", json={"tier": "tape"}).status_code == 404
    assert api.post("/v1/files/999/pin").status_code == 404
    assert api.post(f"/v1/files/{f['id']}/pin", json={"tier": 3}).status_code == 422
    assert (
        api.post(
            f"/v1/files/{f['id']}/pin", headers={"Authorization": f"Bearer {DATA}"}
        ).status_code
        == 403
    )
    assert disk_snapshot(tmp_path / "data") == before
    r = api.delete(f"/v1/files/{f['id']}/pin")
    assert r.status_code == 200 and r.json()["pinned_tier"] is None


def test_hot_files_move_up_and_cold_files_drift_down(tmp_path: Path) -> None:
    """The done-when: low thresholds, a short interval and half-life, the real app."""
    settings = engine_settings(tmp_path / "data")
    with TestClient(create_app(settings), base_url="http://127.0.0.1") as c:
        policy = {
            "tiers": {"nvme": {"min_heat": 4}, "ssd": {"min_heat": 1}, "hdd": {"min_heat": 0}},
            # Long enough that 20 reads on a loaded 2-core CI box stay above nvme's threshold.
            "half_life_s": 2.0,
            "hysteresis": 0.0,
            "min_age_s": 0,
            "interval_s": 0.1,
            "concurrency": 2,
        }
        assert c.put("/v1/policy", json=policy).status_code == 200
        hot = upload(c, "hot.bin", payload(100_000), tier="hdd")
        idle = upload(c, "idle.bin", payload(50_000), tier="hdd")
        for _ in range(20):
            assert c.get(f"/v1/files/{hot['id']}/content").status_code == 200
        wait_for(lambda: c.get(f"/v1/files/{hot['id']}").json()["tier"] == "nvme", what="promotion")
        assert c.get(f"/v1/files/{idle['id']}").json()["tier"] == "hdd"
        moves = [m for m in c.get("/v1/migrations").json()["items"] if m["file_id"] == hot["id"]]
        up = [m for m in moves if m["to_tier"] == "nvme"]
        assert up and up[0]["state"] == "done" and "promote" in up[0]["reason"]
        assert "→ nvme" in up[0]["reason"]
        # Now idle: its heat halves every two seconds and it drifts back down.
        wait_for(
            lambda: c.get(f"/v1/files/{hot['id']}").json()["tier"] == "hdd",
            timeout=30,
            what="demotion",
        )
        assert (
            c.get(f"/v1/files/{hot['id']}/content").content
            == c.get(f"/v1/files/{hot['id']}/content").content
        )
