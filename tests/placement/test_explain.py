"""Why a file stays: the planner's decisions, one test per reason, the property that plan()
moves exactly what the decisions move, and the REST endpoint, CLI and plan?explain=all."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from app.cli import cli
from app.main import create_app
from tests.helpers import engine_settings, payload, put
from tests.placement.test_policy import NOW, TIERS, F, usage
from tiering.engine import Engine
from tiering.placement import Decision, TierPolicy, TierState, decide, default_policy, plan

ADMIN, DATA = "admin-secret", "data-secret"
P = default_policy(TIERS).model_copy(update={"min_age_s": 0})


def one(files: list[F], fid: int = 1, **kw: object) -> Decision:
    u = kw.pop("usage", None) or usage(files)
    policy = kw.pop("policy", P)
    [d] = [d for d in decide(files, policy, u, NOW, **kw) if d.file_id == fid]  # type: ignore[arg-type]
    return d


def codes(d: Decision) -> list[str]:
    return [r.code for r in d.reasons]


def test_wanted_move() -> None:
    d = one([F(1, "hdd", heat=143.2)])
    assert d.action == "move" and d.move is not None and d.move.dst == "nvme"
    assert d.wanted_tier == "nvme" and d.why == "heat 143.2 ≥ 100.0" and d.reasons == ()


def test_hysteresis() -> None:
    d = one([F(1, "ssd", heat=110.0)])
    assert d.action == "stay" and d.wanted_tier == "nvme" and codes(d) == ["hysteresis"]
    assert d.reasons[0].data["high"] == pytest.approx(120.0)


def test_min_age() -> None:
    policy = P.model_copy(update={"min_age_s": 600.0})
    d = one([F(1, "hdd", heat=500.0, updated_at=NOW - 10)], policy=policy)
    assert codes(d) == ["min_age"] and d.reasons[0].data["age_s"] == pytest.approx(10.0)
    assert "10.0 s < min_age_s 600" in d.reasons[0].message


def test_quota_watermark() -> None:
    tiers = dict(P.tiers) | {"nvme": TierPolicy(min_heat=100, quota_bytes=100)}
    d = one([F(1, "hdd", heat=500.0)], policy=P.model_copy(update={"tiers": tiers}))
    assert d.action == "move" and d.move is not None and d.move.dst == "ssd"
    d = one(
        [F(1, "ssd", heat=500.0)],
        policy=P.model_copy(update={"tiers": tiers}),
    )
    assert d.action == "stay" and codes(d) == ["quota"]
    assert d.reasons[0].data["limit_bytes"] == 80


def test_free_space() -> None:
    files = [F(1, "ssd", heat=500.0)]
    d = one(files, usage=usage(files, nvme=TierState("nvme", 0, free_bytes=50)))
    assert d.action == "stay" and codes(d) == ["free_space"]
    assert d.reasons[0].data["free_bytes"] == 50


def test_pin() -> None:
    d = one([F(1, "hdd", heat=500.0, pinned_tier="hdd")])
    assert d.action == "stay" and d.wanted_tier == "hdd" and codes(d) == ["pin"]
    assert "pinned to hdd" in d.reasons[0].message


def test_in_flight() -> None:
    d = one([F(1, "hdd", heat=500.0, state="migrating")], in_flight={1: 42})
    assert codes(d) == ["in_flight"] and d.reasons[0].data["intent_id"] == 42


def test_scheduler_disabled() -> None:
    d = one([F(1, "hdd", heat=500.0)], scheduler_on=False)
    assert d.action == "move" and codes(d) == ["scheduler_disabled"]
    assert one([F(1, "hdd", heat=0.0)], scheduler_on=False).reasons == ()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(TIERS),
            st.integers(1, 400),
            st.floats(0, 1000),
            st.sampled_from([None, *TIERS]),
            st.sampled_from(["stable", "stable", "migrating"]),
            st.floats(0, NOW),
        ),
        max_size=12,
    ),
    st.lists(st.one_of(st.none(), st.integers(0, 2000)), min_size=3, max_size=3),
    st.one_of(st.none(), st.integers(0, 2000)),
)
def test_plan_moves_what_decide_moves(rows, free, quota) -> None:  # type: ignore[no-untyped-def]
    files = [
        F(i + 1, t, size=s, heat=h, pinned_tier=p, state=state, updated_at=u)
        for i, (t, s, h, p, state, u) in enumerate(rows)
    ]
    u = usage(files)
    u = {n: TierState(n, u[n].used_bytes, free[i], quota) for i, n in enumerate(TIERS)}
    policy = default_policy(TIERS)
    moves = plan(files, policy, u, NOW)
    decisions = decide(files, policy, u, NOW)
    assert {m.file_id for m in moves} == {d.file_id for d in decisions if d.move is not None}
    assert sorted(moves, key=lambda m: m.file_id) == sorted(
        (d.move for d in decisions if d.move is not None), key=lambda m: m.file_id
    )
    for d in decisions:
        assert (d.move is None) == (d.action == "stay")


@pytest.fixture
def api(tmp_path: Path) -> Iterator[TestClient]:
    s = engine_settings(tmp_path / "data", admin_token=ADMIN, data_token=DATA)
    with TestClient(create_app(s), base_url="http://127.0.0.1") as c:
        c.headers["Authorization"] = f"Bearer {ADMIN}"
        yield c


def upload(c: TestClient, path: str, data: bytes, tier: str = "nvme") -> int:
    r = c.put("/v1/files/content", params={"path": path, "tier": tier}, content=data)
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def test_rest_placement(api: TestClient) -> None:
    fid = upload(api, "cold.bin", b"c" * 100)
    r = api.get(f"/v1/files/{fid}/placement", headers={"Authorization": f"Bearer {DATA}"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tier"] == "nvme" and body["wanted_tier"] == "hdd" and body["action"] == "stay"
    assert "min_age" in [x["code"] for x in body["reasons"]]
    assert api.get("/v1/files/9999/placement").status_code == 404
    assert api.get(f"/v1/files/{10**30}/placement").status_code == 422


def test_plan_explain_all_paginates(api: TestClient) -> None:
    ids = [upload(api, f"f{i}.bin", b"x" * 10) for i in range(5)]
    plain = api.post("/v1/policy/plan").json()
    assert set(plain) == {"policy_version", "at", "moves"}
    seen: list[int] = []
    cursor = None
    for _ in range(5):
        params: dict[str, object] = {"explain": "all", "limit": 2}
        if cursor is not None:
            params["cursor"] = cursor
        r = api.post("/v1/policy/plan", params=params)
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["held"]) <= 2 and body["moves"] == []
        seen += [h["file_id"] for h in body["held"]]
        assert all("min_age" in [x["code"] for x in h["reasons"]] for h in body["held"])
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == ids
    assert api.post("/v1/policy/plan", params={"explain": "some"}).status_code == 422


def test_cli_explain(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with Engine(engine_settings(data).engine_config()) as eng:
        put(eng, "m/x.bin", payload(10))
    r = CliRunner().invoke(cli, ["explain", "m/x.bin", "--json", "--data-dir", str(data)])
    assert r.exit_code == 0, r.output
    body = json.loads(r.output)
    assert body["wanted_tier"] == "hdd" and body["action"] == "stay"
    assert [x["code"] for x in body["reasons"]] == ["min_age"]
    r = CliRunner().invoke(cli, ["explain", "m/x.bin", "--data-dir", str(data)])
    assert r.exit_code == 0 and "wants hdd" in r.output and "min_age" in r.output
