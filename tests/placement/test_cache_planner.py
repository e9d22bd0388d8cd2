"""The memory tier's planner (a pure function): examples, then Hypothesis for its invariants;
and the policy's rules for a memory tier beside the storage planner's."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiering.placement import (
    CachedCopy,
    Policy,
    TierPolicy,
    TierState,
    default_policy,
    plan,
    plan_cache,
)

NOW = 1_000_000.0
TIERS = ["ram", "nvme", "ssd", "hdd"]


@dataclass(frozen=True)
class F:
    id: int
    size: int = 100
    heat: float = 0.0
    generation: int = 0
    state: str = "stable"
    tier: str = "nvme"
    heat_at: float = NOW
    pinned_tier: str | None = None
    updated_at: float = 0.0

    @property
    def relpath(self) -> str:
        return f"f{self.id}"


def policy(quota: int | None = 1000, min_heat: float = 200.0, h: float = 0.2) -> Policy:
    base = default_policy(TIERS, memory="ram")
    rules = {**base.tiers, "ram": TierPolicy(min_heat=min_heat, quota_bytes=quota)}
    return base.model_copy(update={"tiers": rules, "hysteresis": h})


def test_default_policy_puts_the_memory_tier_above_the_storage_thresholds() -> None:
    p = default_policy(TIERS, memory="ram")
    assert [p.tiers[n].min_heat for n in TIERS] == [200, 100, 10, 0]  # storage as without it
    assert default_policy(["ram", "disk"], memory="ram").tiers["ram"].min_heat == 10
    # A document set before the memory tier existed gets its default rules.
    old = default_policy(TIERS[1:]).document()
    parsed = Policy.parse(old, TIERS, memory="ram")
    assert list(parsed.tiers) == TIERS and parsed.tiers["ram"].min_heat == 200


def test_the_storage_planner_never_plans_for_the_memory_tier() -> None:
    # Hot enough for ram: its home is still the fastest storage tier.
    files = [F(1, tier="hdd", heat=10_000.0), F(2, tier="nvme", heat=10_000.0)]
    usage = {n: TierState(n, 0) for n in TIERS[1:]}
    moves = plan(files, policy().without(["ram"]), usage, NOW)
    assert [(m.file_id, m.src, m.dst) for m in moves] == [(1, "hdd", "nvme")]


def test_fills_hottest_first_up_to_the_low_watermark() -> None:
    heats = {1: 300, 2: 1000, 3: 500, 4: 239, 5: 5000, 7: 250}
    files = [F(i, heat=h, size=250) for i, h in heats.items()]
    files.append(F(6, heat=9000, size=900))  # hottest, but larger than the low watermark
    files.append(F(8, heat=260, size=50))  # colder, but small enough for the room left
    p = plan_cache(files, policy(), "ram", [], NOW)
    # Low watermark: 80 % of 1000 = 800. 239 < 200 × 1.2 does not qualify.
    assert [f.file_id for f in p.fills] == [5, 2, 3, 8]
    assert p.fills[0].reason == "heat 5000.0 ≥ 200.0 (+20% hysteresis): copy into ram"
    assert p.drops == []


def test_only_stable_files_are_filled() -> None:
    files = [F(1, heat=900, state="migrating"), F(2, heat=900, state="missing"), F(3, heat=900)]
    assert [f.file_id for f in plan_cache(files, policy(), "ram", [], NOW).fills] == [3]


def test_cold_and_stale_copies_are_dropped_hot_ones_stay() -> None:
    files = [F(1, heat=170), F(2, heat=150), F(3, heat=900, generation=2), F(5, heat=10)]
    copies = [
        CachedCopy(1, 0, 100),  # 170 ≥ 160: within the hysteresis band, stays
        CachedCopy(2, 0, 100),  # 150 < 200 × 0.8: cold
        CachedCopy(3, 1, 100),  # the file changed (generation 2)
        CachedCopy(4, 0, 100),  # the file is gone
        CachedCopy(5, 0, 100, held=True),  # cold, but a load holds it
    ]
    p = plan_cache(files, policy(), "ram", copies, NOW)
    assert sorted((d.file_id, d.code) for d in p.drops) == [(2, "cold"), (3, "stale"), (4, "stale")]
    assert [f.file_id for f in p.fills] == [3]  # its new generation is hot: copied again


def test_past_the_high_watermark_the_coldest_go_until_under_the_low() -> None:
    # A quota lowered under what is held: 950 > 90 % of 1000.
    files = [F(i, heat=300 + i, size=190) for i in range(1, 6)]
    copies = [CachedCopy(i, 0, 190) for i in range(1, 6)]
    copies[0] = CachedCopy(1, 0, 190, keep_until=NOW + 1)  # kept by a prefetch: stays
    p = plan_cache(files, policy(), "ram", copies, NOW)
    # Kept: 1 (protected) + 5, 4, 3 hottest while ≤ 800; 2 goes.
    assert [(d.file_id, d.code) for d in p.drops] == [(2, "watermark")]
    assert p.fills == []


def files_and_copies() -> st.SearchStrategy[tuple[list[F], list[CachedCopy]]]:
    states = ["stable", "migrating", "missing"]

    def build(
        rows: list[tuple[int, float, int, bool, bool, int]],
    ) -> tuple[list[F], list[CachedCopy]]:
        files, copies = [], []
        for i, (size, heat, gen, cached, held, state) in enumerate(rows, start=1):
            files.append(F(i, size=size, heat=heat, generation=gen, state=states[state]))
            if cached:
                copies.append(CachedCopy(i, gen if gen % 3 else 0, size, held=held))
        return files, copies

    row = st.tuples(
        st.integers(0, 400),
        st.sampled_from([0.0, 100.0, 159.0, 161.0, 200.0, 239.0, 241.0, 500.0, 5000.0]),
        st.integers(0, 4),
        st.booleans(),
        st.booleans(),
        st.sampled_from([0, 0, 0, 1, 2]),
    )
    return st.lists(row, max_size=12).map(build)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(data=files_and_copies(), quota=st.sampled_from([None, 0, 300, 1000, 2500]))
def test_invariants(data: tuple[list[F], list[CachedCopy]], quota: int | None) -> None:
    files, copies = data
    pol = policy(quota)
    p = plan_cache(files, pol, "ram", copies, NOW)
    by_id = {f.id: f for f in files}
    dropped = {d.file_id for d in p.drops}
    held = {c.file_id for c in copies if c.held}
    # A held copy is only ever dropped because its file changed (freed at its release).
    assert all(d.code == "stale" for d in p.drops if d.file_id in held)
    # Fills: stable files only, never one with a current copy, at most once each.
    fills = [f.file_id for f in p.fills]
    assert len(fills) == len(set(fills))
    current = {c.file_id for c in copies if c.file_id not in dropped}
    assert not set(fills) & current
    assert all(by_id[i].state == "stable" for i in fills)
    after = [c for c in copies if c.file_id not in dropped]
    after += [CachedCopy(f.file_id, f.generation, f.size) for f in p.fills]
    if quota is not None and p.fills:
        # Fills never take it past the low watermark.
        protected = sum(c.size for c in after if c.held)
        assert sum(c.size for c in after) <= max(quota * 0.8, protected + 0)
    # Applying the plan and planning again yields nothing.
    again = plan_cache(files, pol, "ram", after, NOW)
    assert not again, again
