"""The policy document and the planner: examples, then Hypothesis for the invariants."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiering.errors import InvalidPolicy
from tiering.placement import Policy, TierPolicy, TierState, default_policy, plan

NOW = 1_000_000.0
TIERS = ["nvme", "ssd", "hdd"]


@dataclass(frozen=True)
class F:
    id: int
    tier: str
    size: int = 100
    heat: float = 0.0
    heat_at: float = NOW
    pinned_tier: str | None = None
    state: str = "stable"
    updated_at: float = 0.0

    @property
    def relpath(self) -> str:
        return f"f{self.id}"


def usage(files: list[F], names: list[str] = TIERS, **kw: TierState) -> dict[str, TierState]:
    out = {n: TierState(n, sum(f.size for f in files if f.tier == n)) for n in names}
    out.update(kw)
    return out


def test_defaults() -> None:
    p = default_policy(TIERS)
    assert [p.tiers[n].min_heat for n in TIERS] == [100, 10, 0]
    assert p.half_life_s == 86_400 and p.hysteresis > 0 and p.min_age_s > 0
    assert p.concurrency >= 1 and p.bandwidth_bytes_per_s and p.interval_s > 0
    assert [t.min_heat for t in default_policy(["fast", "slow"]).tiers.values()] == [10, 0]
    assert Policy.parse(p.document(), TIERS) == p


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"tiers": {"nvme": {"min_heat": 100}, "ssd": {"min_heat": 10}}},
            "missing rules for tier 'hdd'",
        ),
        (
            {
                "tiers": {
                    **{n: {"min_heat": h} for n, h in zip(TIERS, [100, 10, 0], strict=False)},
                    "tape": {"min_heat": 0},
                }
            },
            "unknown tier 'tape'",
        ),
        (
            {
                "tiers": {
                    "nvme": {"min_heat": 100},
                    "ssd": {"min_heat": 150},
                    "hdd": {"min_heat": 0},
                }
            },
            "tiers.ssd.min_heat: must be below nvme's min_heat (100)",
        ),
        (
            {"tiers": {"nvme": {"min_heat": 100}, "ssd": {"min_heat": 10}, "hdd": {"min_heat": 1}}},
            "tiers.hdd.min_heat: must be 0",
        ),
        (
            {
                "tiers": {
                    "nvme": {"min_heat": 100, "high_watermark": 0.5, "low_watermark": 0.7},
                    "ssd": {"min_heat": 10},
                    "hdd": {"min_heat": 0},
                }
            },
            "low_watermark (0.7) must not be above high_watermark (0.5)",
        ),
        ({"hysteresis": 1.5}, "hysteresis: Input should be less than 1"),
        ({"half_life_s": 0}, "half_life_s: Input should be greater than 0"),
        ({"concurrency": "many"}, "concurrency: Input should be a valid integer"),
        ({"bogus": 1}, "bogus: unknown field"),
        (
            {"tiers": {"nvme": {"min_heat": -1}, "ssd": {"min_heat": 10}, "hdd": {"min_heat": 0}}},
            "tiers.nvme.min_heat: Input should be greater than or equal to 0",
        ),
    ],
)
def test_invalid_policies_say_precisely_what_is_wrong(change: dict, message: str) -> None:
    doc = default_policy(TIERS).document() | change
    with pytest.raises(InvalidPolicy) as exc:
        Policy.parse(doc, TIERS)
    assert message in exc.value.message, exc.value.message
    with pytest.raises(InvalidPolicy, match="JSON object"):
        Policy.parse([1], TIERS)


def test_reasons_and_hysteresis() -> None:
    p = default_policy(TIERS)
    files = [
        F(1, "ssd", heat=143.2),  # promote
        F(2, "ssd", heat=105.0),  # above 100 but inside the +20% band: stays
        F(3, "ssd", heat=9.0),  # below 10 but inside the -20% band: stays
        F(4, "ssd", heat=3.0),  # demote
        F(5, "nvme", heat=500.0),  # where it belongs
        F(6, "hdd", heat=50.0, updated_at=NOW - 10),  # too young to move
        F(7, "hdd", heat=50.0, state="migrating"),  # not stable
        F(8, "hdd", heat=0.0, pinned_tier="nvme"),  # pinned: goes to its pin
        F(9, "nvme", heat=0.0, pinned_tier="nvme"),  # cold but pinned: stays
    ]
    moves = {m.file_id: m for m in plan(files, p, usage(files), NOW)}
    assert set(moves) == {1, 4, 8}
    assert moves[1].reason == "heat 143.2 ≥ 100.0 (+20% hysteresis): promote ssd → nvme"
    assert moves[4].reason == "heat 3.0 < 10.0 (-20% hysteresis): demote ssd → hdd"
    assert moves[8].reason == "pinned to nvme: move hdd → nvme" and moves[8].kind == "pin"
    # Departures come first.
    assert [m.file_id for m in plan(files, p, usage(files), NOW)][0] == 4


def test_heat_decays_with_the_policy_half_life() -> None:
    p = default_policy(TIERS).model_copy(update={"half_life_s": 10.0})
    f = F(1, "nvme", heat=400.0, heat_at=NOW - 40)  # 400 / 2**4 = 25: ssd
    [m] = plan([f], p, usage([f]), NOW)
    assert (m.dst, m.kind) == ("ssd", "demote")


def test_watermarks_demote_coldest_until_below_low_mark() -> None:
    tiers = {n: TierPolicy(min_heat=h) for n, h in zip(TIERS, [100, 10, 0], strict=False)}
    tiers["nvme"] = TierPolicy(
        min_heat=100, quota_bytes=1000, high_watermark=0.9, low_watermark=0.5
    )
    p = Policy(tiers=tiers, min_age_s=0)
    files = [F(i, "nvme", size=100, heat=1000.0 + i) for i in range(10)]  # 1000 bytes: full
    moves = plan(files, p, usage(files), NOW)
    assert [m.file_id for m in moves] == [0, 1, 2, 3, 4]  # coldest first, down to 500
    assert all(m.kind == "watermark" and m.dst == "ssd" for m in moves)
    assert "over its high watermark" in moves[0].reason
    # A hot file below never promotes into a tier past its low mark.
    files2 = [F(i, "nvme", size=100, heat=1000.0) for i in range(8)] + [F(99, "ssd", heat=1e6)]
    assert plan(files2, p, usage(files2), NOW) == []


def test_never_past_free_space() -> None:
    p = default_policy(TIERS).model_copy(update={"min_age_s": 0})
    files = [F(1, "hdd", size=600, heat=1e3), F(2, "hdd", size=600, heat=2e3)]
    u = usage(files) | {"nvme": TierState("nvme", 0, free_bytes=1000)}
    moves = {m.file_id: m for m in plan(files, p, u, NOW)}
    # The hotter one fits on nvme; the other goes as far as there is room.
    assert moves[2].dst == "nvme" and moves[1].dst == "ssd"
    assert "nvme has no room" in moves[1].reason


# -- Hypothesis ----------------------------------------------------------------------------------
@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[F], Policy, dict[str, TierState]]:
    n = draw(st.integers(2, 4))
    names = TIERS[:n] if n <= 3 else ["a", "b", "c", "d"]
    heats = sorted(
        draw(st.lists(st.floats(0.5, 1000), min_size=n - 1, max_size=n - 1, unique=True)),
        reverse=True,
    ) + [0.0]
    tiers = {}
    for name, h in zip(names, heats, strict=False):
        low = draw(st.floats(0.0, 1.0))
        tiers[name] = TierPolicy(
            min_heat=h,
            quota_bytes=draw(st.none() | st.integers(0, 3000)),
            low_watermark=low,
            high_watermark=draw(st.floats(max(low, 0.01), 1.0)),
        )
    policy = Policy(
        tiers=tiers,
        hysteresis=draw(st.sampled_from([0.0, 0.2, 0.5])),
        min_age_s=draw(st.sampled_from([0.0, 100.0])),
        half_life_s=draw(st.sampled_from([10.0, 1000.0])),
    )
    nfiles = draw(st.integers(0, 25))
    files = [
        F(
            i,
            draw(st.sampled_from(names)),
            size=draw(st.integers(0, 700)),
            heat=draw(st.floats(0, 2000)),
            heat_at=NOW - draw(st.sampled_from([0.0, 5.0, 50.0])),
            pinned_tier=draw(st.none() | st.none() | st.sampled_from(names)),
            state=draw(st.sampled_from(["stable"] * 5 + ["migrating", "missing", "quarantined"])),
            updated_at=NOW - draw(st.sampled_from([0.0, 50.0, 1000.0])),
        )
        for i in range(nfiles)
    ]
    u = {
        n_: TierState(
            n_,
            sum(f.size for f in files if f.tier == n_),
            free_bytes=draw(st.none() | st.integers(0, 3000)),
            quota_bytes=draw(st.none() | st.integers(0, 3000)),
        )
        for n_ in names
    }
    return files, policy, u


def _apply(
    files: list[F], moves: list, u: dict[str, TierState]
) -> tuple[list[F], dict[str, TierState]]:
    dst = {m.file_id: m.dst for m in moves}
    new = [replace(f, tier=dst[f.id], updated_at=NOW) if f.id in dst else f for f in files]
    u2 = {}
    for name, s in u.items():
        used = sum(f.size for f in new if f.tier == name)
        free = None if s.free_bytes is None else s.free_bytes - (used - s.used_bytes)
        u2[name] = TierState(name, used, free, s.quota_bytes)
    return new, u2


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_planner_invariants(case: tuple[list[F], Policy, dict[str, TierState]]) -> None:
    files, policy, u = case
    moves = plan(files, policy, u, NOW)
    by_id = {f.id: f for f in files}
    # One move per file, only of stable files, from where they are.
    assert len({m.file_id for m in moves}) == len(moves)
    for m in moves:
        f = by_id[m.file_id]
        assert f.state == "stable" and m.src == f.tier and m.dst != m.src and m.reason
        if f.pinned_tier is not None:
            assert m.dst == f.pinned_tier, "moved against its pin"
    # Never overfills: a tier that receives anything ends within its capacity and high mark;
    # one that receives nothing never grows.
    for name, s in u.items():
        arriving = sum(m.size for m in moves if m.dst == name)
        leaving = sum(m.size for m in moves if m.src == name)
        final = s.used_bytes - leaving + arriving
        if arriving:
            tp = policy.tiers[name]
            quota = tp.quota_bytes if tp.quota_bytes is not None else s.quota_bytes
            if quota is not None:
                assert final <= quota * tp.high_watermark + 1e-6, (name, final, quota)
            if s.free_bytes is not None:
                assert final <= s.used_bytes + s.free_bytes, (name, final)
        else:
            assert final <= s.used_bytes
    # Idempotent: apply, plan again at the same instant: nothing new.
    files2, u2 = _apply(files, moves, u)
    assert plan(files2, policy, u2, NOW) == []
    # And with no minimum age (moved files are eligible again) it still holds.
    p0 = policy.model_copy(update={"min_age_s": 0.0})
    m0 = plan(files, p0, u, NOW)
    f3, u3 = _apply(files, m0, u)
    assert plan(f3, p0, u3, NOW) == []
