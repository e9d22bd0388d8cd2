"""A model moves as one unit in the placement policy: examples of each rule, then Hypothesis
for the planner's invariants over catalogs that hold models, and ``explain`` over REST."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.main import create_app
from tests.conftest import wait_for
from tests.helpers import engine_settings
from tests.placement.test_policy import _apply
from tiering.placement import (
    Decision,
    Policy,
    TierPolicy,
    TierState,
    decide,
    default_policy,
    plan,
)

NOW = 1_000_000.0
TIERS = ["nvme", "ssd", "hdd"]
P = default_policy(TIERS).model_copy(update={"min_age_s": 0})


@dataclass(frozen=True)
class F:
    id: int
    relpath: str
    tier: str
    size: int = 100
    heat: float = 0.0
    heat_at: float = NOW
    pinned_tier: str | None = None
    state: str = "stable"
    updated_at: float = 0.0


def usage(files: list[F], **kw: TierState) -> dict[str, TierState]:
    out = {n: TierState(n, sum(f.size for f in files if f.tier == n)) for n in TIERS}
    return out | kw


def llama(tier: str = "hdd", heats: tuple[float, ...] = (0.0, 0.0, 0.0), **kw: object) -> list[F]:
    """A model of three shards, an index and a config, ids 1-5."""
    shards = [
        F(i + 1, f"models/llama/model-0000{i + 1}-of-00003.safetensors", tier, 300, h)
        for i, h in enumerate(heats)
    ]
    rest = [
        F(4, "models/llama/model.safetensors.index.json", tier, 10, 50.0),
        F(5, "models/llama/config.json", tier, 5, 900.0),
    ]
    return [replace(f, **kw) for f in shards + rest]  # type: ignore[arg-type]


def by_id(decisions: list[Decision]) -> dict[int, Decision]:
    return {d.file_id: d for d in decisions}


def test_a_model_with_one_hot_shard_moves_whole() -> None:
    files = llama(heats=(500.0, 0.0, 3.0))
    moves = plan(files, P, usage(files), NOW)
    assert {m.file_id for m in moves} == {1, 2, 3, 4, 5}
    assert {(m.src, m.dst, m.kind) for m in moves} == {("hdd", "nvme", "promote")}
    assert all(m.heat == 500.0 for m in moves)  # the hottest weights: not the config's 900
    assert "model models/llama (5 files, 915 bytes) moves as one: heat 500.0" in moves[0].reason
    d = by_id(decide(files, P, usage(files), NOW))
    assert {x.model for x in d.values()} == {"models/llama"}
    assert d[2].heat == 500.0 and d[2].wanted_tier == "nvme"
    assert d[2].why == "model models/llama: heat 500.0 ≥ 100.0"


def test_config_reads_alone_do_not_move_the_weights() -> None:
    files = llama(tier="ssd")  # config.json at 900, weights cold
    moves = plan(files, P, usage(files), NOW)
    assert {(m.file_id, m.dst) for m in moves} == {(i, "hdd") for i in range(1, 6)}


def test_a_model_that_does_not_fit_stays_whole_with_its_reason() -> None:
    # nvme's low mark is 80 % of 1000: one 300-byte shard would fit, the 915-byte model not.
    tiers = dict(P.tiers) | {"nvme": TierPolicy(min_heat=100, quota_bytes=1000)}
    policy = P.model_copy(update={"tiers": tiers})
    files = llama(tier="ssd", heats=(500.0, 500.0, 500.0))
    assert plan(files, policy, usage(files), NOW) == []
    d = by_id(decide(files, policy, usage(files), NOW))
    for x in d.values():
        assert x.action == "stay" and x.wanted_tier == "nvme" and x.model == "models/llama"
        [reason] = x.reasons
        assert reason.code == "quota" and reason.data["model"] == "models/llama"
        assert reason.data["size"] == 915 and reason.data["limit_bytes"] == 800
        assert "0 + 915 bytes > 80% of quota 1000" in reason.message
        assert "model models/llama (5 files, 915 bytes) moves whole or not at all" in reason.message
    # With free space as the limit instead, the reason says so, with the model's bytes.
    u = usage(files, nvme=TierState("nvme", 0, free_bytes=900))
    [reason] = by_id(decide(files, P, u, NOW))[3].reasons
    assert reason.code == "free_space" and reason.data == {
        "tier": "nvme",
        "free_bytes": 900,
        "size": 915,
        "model": "models/llama",
        "files": 5,
    }


def test_when_the_fastest_tier_lacks_room_the_model_goes_whole_to_the_next() -> None:
    tiers = dict(P.tiers) | {"nvme": TierPolicy(min_heat=100, quota_bytes=1000)}
    files = llama(tier="hdd", heats=(500.0, 0.0, 0.0))
    moves = plan(files, P.model_copy(update={"tiers": tiers}), usage(files), NOW)
    assert {(m.file_id, m.dst) for m in moves} == {(i, "ssd") for i in range(1, 6)}
    assert "nvme has no room" in moves[0].reason


def test_a_split_model_is_gathered_where_most_of_it_is() -> None:
    files = llama(tier="ssd", heats=(20.0, 20.0, 20.0))
    files[0] = replace(files[0], tier="hdd")  # one shard left behind on a slow tier
    moves = plan(files, P, usage(files), NOW)
    assert [(m.file_id, m.src, m.dst, m.kind) for m in moves] == [(1, "hdd", "ssd", "gather")]
    assert "its files are split over ssd, hdd: gather them on ssd" in moves[0].reason
    # No room where most of it is: the whole model goes to the next tier with room.
    u = usage(files, ssd=TierState("ssd", 615, free_bytes=100))
    moves = plan(files, P, u, NOW)
    assert {(m.file_id, m.dst) for m in moves} == {(i, "hdd") for i in range(2, 6)}
    assert "(ssd has no room for all of them)" in moves[0].reason


def test_a_split_model_that_cannot_gather_says_why() -> None:
    files = llama(tier="ssd", heats=(20.0, 20.0, 20.0), updated_at=NOW - 5)
    files[0] = replace(files[0], tier="hdd")
    policy = P.model_copy(update={"min_age_s": 600.0})
    d = by_id(decide(files, policy, usage(files), NOW))
    assert d[1].action == "stay" and [r.code for r in d[1].reasons] == ["min_age"]


def test_a_pin_on_one_file_pins_the_model() -> None:
    files = llama(tier="ssd", heats=(20.0, 20.0, 20.0))
    files[2] = replace(files[2], pinned_tier="nvme")
    moves = plan(files, P, usage(files), NOW)
    assert {(m.file_id, m.dst, m.kind) for m in moves} == {(i, "nvme", "pin") for i in range(1, 6)}
    # Pins to different tiers ask for the split: each file follows its own pin.
    files[0] = replace(files[0], pinned_tier="hdd")
    split = {m.file_id: m for m in plan(files, P, usage(files), NOW)}
    assert split[1].dst == "hdd" and split[3].dst == "nvme" and 2 not in split
    assert by_id(decide(files, P, usage(files), NOW))[2].model is None


def test_a_busy_or_missing_file() -> None:
    files = llama(heats=(500.0, 0.0, 0.0))
    # A file in flight holds its whole model back, and says which file it is.
    busy = [replace(files[0], state="migrating"), *files[1:]]
    assert plan(busy, P, usage(busy), NOW) == []
    [reason] = by_id(decide(busy, P, usage(busy), NOW, in_flight={1: 7}))[4].reasons
    assert reason.code == "in_flight" and reason.data == {"intent_id": 7, "model": "models/llama"}
    assert reason.message.startswith("models/llama/model-00001-of-00003.safetensors of model")
    # A missing file (its bytes are gone) is no part of the model, and holds nothing back.
    gone = [replace(files[1], state="missing"), files[0], *files[2:]]
    moves = plan(gone, P, usage(gone), NOW)
    assert {m.file_id for m in moves} == {1, 3, 4, 5}


# -- Hypothesis ----------------------------------------------------------------------------------
@st.composite
def catalogs(draw: st.DrawFn) -> tuple[list[F], Policy, dict[str, TierState]]:
    heats = [100.0, 10.0, 0.0]
    tiers = {
        n: TierPolicy(min_heat=h, quota_bytes=draw(st.none() | st.integers(0, 4000)))
        for n, h in zip(TIERS, heats, strict=True)
    }
    policy = Policy(
        tiers=tiers,
        hysteresis=draw(st.sampled_from([0.0, 0.2])),
        min_age_s=draw(st.sampled_from([0.0, 100.0])),
    )
    names = ["m0/model.safetensors", "m0/config.json", "m1/a.safetensors", "m1/b.safetensors"]
    names += ["m1/model.safetensors.index.json", "m1/sub/x.safetensors", "solo.bin", "m2/t.json"]
    files = [
        F(
            i + 1,
            draw(st.sampled_from(names)) + ("" if i < 8 else f".{i}"),
            draw(st.sampled_from(TIERS)),
            size=draw(st.integers(0, 700)),
            heat=draw(st.floats(0, 1000)),
            pinned_tier=draw(st.none() | st.none() | st.none() | st.sampled_from(TIERS)),
            state=draw(st.sampled_from(["stable"] * 6 + ["migrating", "missing"])),
            updated_at=NOW - draw(st.sampled_from([0.0, 1000.0])),
        )
        for i in range(draw(st.integers(0, 14)))
    ]
    files = list({f.relpath: f for f in files}.values())  # relpaths are unique
    u = {
        n: TierState(
            n,
            sum(f.size for f in files if f.tier == n),
            free_bytes=draw(st.none() | st.integers(0, 3000)),
        )
        for n in TIERS
    }
    return files, policy, u


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(catalogs())
def test_models_move_whole(case: tuple[list[F], Policy, dict[str, TierState]]) -> None:
    files, policy, u = case
    decisions = decide(files, policy, u, NOW)
    moves = plan(files, policy, u, NOW)
    # One function makes moves and reasons: plan() is exactly what decide() moves.
    assert sorted(moves, key=lambda m: m.file_id) == sorted(
        (d.move for d in decisions if d.move is not None), key=lambda m: m.file_id
    )
    # A model that moves ends whole on one tier; one that does not, moves no file at all.
    after = {f.id: f.tier for f in files} | {m.file_id: m.dst for m in moves}
    moved = {m.file_id for m in moves}
    units: dict[str, list[Decision]] = {}
    for d in decisions:
        if d.model is not None:
            units.setdefault(d.model, []).append(d)
    for model, members in units.items():
        assert all(d.relpath.rpartition("/")[0] == model for d in members)
        if any(d.file_id in moved for d in members):
            assert len({after[d.file_id] for d in members}) == 1, (model, members)
        assert len({d.wanted_tier for d in members}) == 1 and len({d.heat for d in members}) == 1
    # Only stable files move; pins are obeyed; never past a tier's room (test_policy's rules).
    by = {f.id: f for f in files}
    for m in moves:
        assert by[m.file_id].state == "stable" and m.src == by[m.file_id].tier != m.dst
        if by[m.file_id].pinned_tier is not None:
            assert m.dst == by[m.file_id].pinned_tier
    for name, s in u.items():
        arriving = sum(m.size for m in moves if m.dst == name)
        final = s.used_bytes - sum(m.size for m in moves if m.src == name) + arriving
        if arriving and s.free_bytes is not None:
            assert final <= s.used_bytes + s.free_bytes
        quota = policy.tiers[name].quota_bytes
        if arriving and quota is not None:
            assert final <= quota * policy.tiers[name].high_watermark + 1e-6
    # Applying the plan and planning again yields nothing.
    files2, u2 = _apply(files, moves, u)  # type: ignore[arg-type]
    assert plan(files2, policy, u2, NOW) == []
    p0 = policy.model_copy(update={"min_age_s": 0.0})
    f3, u3 = _apply(files, plan(files, p0, u, NOW), u)  # type: ignore[arg-type]
    assert plan(f3, p0, u3, NOW) == []


# -- explain over REST ---------------------------------------------------------------------------
@pytest.fixture
def api(tmp_path: Path) -> Iterator[TestClient]:
    s = engine_settings(tmp_path / "data", watch=False)
    with TestClient(create_app(s), base_url="http://127.0.0.1") as c:
        yield c


def test_explain_shows_the_model_and_why_it_stays(api: TestClient) -> None:
    ids = []
    for name, data in [("model.safetensors", b"w" * 600), ("config.json", b"{}")]:
        r = api.put(
            "/v1/files/content", params={"path": f"m/tiny/{name}", "tier": "hdd"}, content=data
        )
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    policy = api.get("/v1/policy").json()["policy"]
    policy["min_age_s"] = 0
    policy["tiers"]["nvme"] = {"min_heat": 1, "quota_bytes": 500}
    policy["tiers"]["ssd"] = {"min_heat": 0.5, "quota_bytes": 500}
    assert api.put("/v1/policy", json=policy).status_code == 200
    for _ in range(3):  # the weights get hot; the config stays cold
        assert api.get(f"/v1/files/{ids[0]}/content").status_code == 200
    wait_for(lambda: api.get(f"/v1/files/{ids[0]}").json()["heat"] > 2.5, what="accesses counted")
    for fid in ids:
        d = api.get(f"/v1/files/{fid}/placement").json()
        assert d["model"] == "m/tiny" and d["action"] == "stay" and d["wanted_tier"] == "nvme"
        assert [r["code"] for r in d["reasons"]] == ["quota"]
        assert d["reasons"][0]["data"]["size"] == 602
        assert "m/tiny (2 files, 602 bytes) moves whole or not at all" in d["reasons"][0]["message"]
