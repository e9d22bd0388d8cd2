"""The copy planner's passes on a fleet: real PostgreSQL, a real bucket (moto), two hosts'
engines in-process with their own data directories. Heat comes from each host's own access
flushes; time moves by the ``now`` the passes take. A shared file whose heat reaches a tier's
``min_heat`` (+ hysteresis) gets a copy there on the next pass, one that cools (past the
hysteresis) loses it, past the quota's high watermark the coldest copies go until under the
low one, a file is copied to one tier only (the fastest its heat earns), each host copies by
its own heat or the fleet's as ``promotion_heat`` says, and a pass after a pass plans nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fleet.copy_support import (
    HL,
    PREFIX,
    copy_bytes,
    fleet_config,
    hc,
    heat,
    held,
    policy_doc,
    put_objects,
    set_policy,
    started,
)
from tiering.engine import Engine


@dataclass
class Fleet:
    a: Engine
    b: Engine
    data: dict[str, bytes]
    ids: list[int]  # file ids of f0.bin, f1.bin, ...

    def id(self, i: int) -> int:
        return self.ids[i]


@pytest.fixture
def objects(s3_client: Any, s3_bucket: str, s3_env: Any) -> dict[str, bytes]:
    return put_objects(s3_client, s3_bucket)


def _fleet(
    tmp_path: Path, pg_url: str, endpoint: str, bucket: str, data: dict[str, bytes], **kw: Any
) -> Iterator[Fleet]:
    ca = fleet_config(tmp_path / "a", "host-a", pg_url, endpoint, bucket, **kw)
    cb = fleet_config(tmp_path / "b", "host-b", pg_url, endpoint, bucket, **kw)
    with started(ca) as a, started(cb) as b:
        ids = [a.lookup(f"f{i}.bin").id for i in range(len(data))]
        assert {a.get(i).tier for i in ids} == {"s3"}
        set_policy(policy_doc(), a, b)
        yield Fleet(a, b, data, ids)


@pytest.fixture
def fleet(
    tmp_path: Path, pg_url: str, moto_endpoint: str, s3_bucket: str, objects: dict[str, bytes]
) -> Iterator[Fleet]:
    yield from _fleet(tmp_path, pg_url, moto_endpoint, s3_bucket, objects)


def settled(engine: Engine, now: float) -> bool:
    """Planning again at ``now`` yields nothing."""
    return not any(hc(engine).plan(now).values())


def objects_intact(s3_client: Any, bucket: str, data: dict[str, bytes]) -> None:
    for rel, body in data.items():
        got = s3_client.get_object(Bucket=bucket, Key=f"{PREFIX}/{rel}")["Body"].read()
        assert got == body, rel


def test_copies_follow_heat_with_hysteresis_and_cooling_drops_them(
    fleet: Fleet, s3_client: Any, s3_bucket: str
) -> None:
    a = fleet.a
    f0, f1, f2, f3 = (fleet.id(i) for i in range(4))
    # nvme: 100 (copy at >= 120, drop under 80); ssd: 10 (copy at >= 12, drop under 8).
    t0 = heat(a, {f0: 110, f1: 130, f2: 11, f3: 119})
    plans = hc(a).plan(t0)
    assert [f.file_id for f in plans["nvme"].fills] == [f1]  # f3's 119 < 120: not yet
    assert [f.file_id for f in plans["ssd"].fills] == [f3, f0]  # hottest first; f2 < 12
    assert "hysteresis" in plans["nvme"].fills[0].reason

    report = hc(a).run_pass(t0)
    assert sorted(report.filled) == sorted([f1, f3, f0]) and report.failed == []
    assert held(a) == {f1: "nvme", f3: "ssd", f0: "ssd"}  # one copy a file, the fastest
    for fid, rel in ((f1, "f1.bin"), (f0, "f0.bin")):
        assert copy_bytes(a, fid) == fleet.data[rel]
    assert settled(a, t0)
    assert held(fleet.b) == {}  # host b read nothing: it copies nothing

    # One half-life on: f1 65 < 80 leaves nvme for ssd; f3 59.5 and f0 55 stay.
    report = hc(a).run_pass(t0 + HL)
    assert report.dropped == [f1] and report.filled == [f1]
    assert [d.code for d in report.plans["nvme"].drops] == ["cold"]
    assert held(a) == {f1: "ssd", f3: "ssd", f0: "ssd"}
    assert settled(a, t0 + HL)

    # 3.5 half-lives on: f0 9.7 is under ssd's min_heat but not under 8: kept.
    report = hc(a).run_pass(t0 + 3.5 * HL)
    assert (report.filled, report.dropped) == ([], [])
    # 5 half-lives on: f0 3.4, f3 3.7 and f1 4.1 are all cold: every copy goes.
    report = hc(a).run_pass(t0 + 5 * HL)
    assert sorted(report.dropped) == sorted([f0, f1, f3])
    assert held(a) == {}
    assert settled(a, t0 + 5 * HL)
    assert {a.get(i).tier for i in fleet.ids} == {"s3"}  # copies, never moves
    objects_intact(s3_client, s3_bucket, fleet.data)


def test_past_the_high_watermark_the_coldest_copies_go_until_under_the_low_one(
    fleet: Fleet,
) -> None:
    a = fleet.a
    ids = fleet.ids
    t0 = heat(a, {fid: 200 + 100 * i for i, fid in enumerate(ids)})  # f4 hottest
    assert sorted(hc(a).run_pass(t0).filled) == sorted(ids)  # no quota: all on nvme
    assert held(a) == dict.fromkeys(ids, "nvme")

    # 5 copies of ~64 KiB (328 KiB) against a quota of 300 000 bytes: high 180 000, low
    # 150 000: two copies fit under the low watermark, three do not.
    nvme = {"min_heat": 100, "quota_bytes": 300_000, "high_watermark": 0.6, "low_watermark": 0.5}
    set_policy(policy_doc(nvme=nvme), a, fleet.b)
    t0 = time.time()  # after the fills (a copy is not dropped in the instant it is made)
    report = hc(a).run_pass(t0)
    drops = report.plans["nvme"].drops
    assert [d.code for d in drops] == ["watermark"] * 3
    assert sorted(report.dropped) == sorted(ids[:3])
    # The dropped ones are hot enough for ssd: they go there, not back to nvme.
    assert held(a) == {ids[3]: "nvme", ids[4]: "nvme", **dict.fromkeys(ids[:3], "ssd")}
    assert settled(a, t0)
    assert sum(e.size for e in hc(a).entries() if e.tier == "nvme") <= 150_000


def test_a_file_with_a_copy_on_a_faster_tier_is_not_copied_to_a_slower_one(
    fleet: Fleet,
) -> None:
    a = fleet.a
    f0, f1 = fleet.id(0), fleet.id(1)
    slow = {**policy_doc(), "half_life_s": 1e6}  # heats stay put past the prefetch's hour
    set_policy(slow, a, fleet.b)
    t0 = heat(a, {f0: 20, f1: 20})  # ssd's heat, not nvme's
    hc(a).fill(f0, "nvme", keep_s=3600)  # a prefetch: kept on nvme for an hour whatever its heat
    plans = hc(a).plan(t0)
    assert [f.file_id for f in plans["ssd"].fills] == [f1]  # not f0: it is on nvme
    assert not plans["nvme"]
    hc(a).run_pass(t0)
    assert held(a) == {f0: "nvme", f1: "ssd"}
    assert settled(a, t0)

    # Once the hour is over, f0 is cold for nvme: its copy moves down to ssd, one copy still.
    later = t0 + 3700  # past the keep, however long the fill took
    report = hc(a).run_pass(later)
    assert report.dropped == [f0] and report.filled == [f0]
    assert held(a) == {f0: "ssd", f1: "ssd"}
    assert settled(a, later)


def test_each_host_copies_by_its_own_heat_or_the_fleet_s_as_policy_says(
    fleet: Fleet, s3_client: Any, s3_bucket: str
) -> None:
    a, b = fleet.a, fleet.b
    f0, f1 = fleet.id(0), fleet.id(1)
    heat(b, {f0: 150})  # read on b only
    t = heat(a, {f1: 150})  # read on a only
    assert a.heat(a.get(f0), t) == pytest.approx(150, rel=0.01)  # the fleet's heat is 150

    # local (the default): each host copies what it reads itself.
    assert hc(a).run_pass(t).filled == [f1]
    assert hc(b).run_pass(t).filled == [f0]
    assert (held(a), held(b)) == ({f1: "nvme"}, {f0: "nvme"})
    assert settled(a, t) and settled(b, t)

    # fleet: a file hot on any host is copied on every host.
    set_policy(policy_doc("fleet"), a, b)
    assert hc(a).run_pass(t).filled == [f0]
    assert hc(b).run_pass(t).filled == [f1]
    assert held(a) == held(b) == {f0: "nvme", f1: "nvme"}
    assert settled(a, t) and settled(b, t)

    # local again, set from b: each host drops the copy only the other one reads.
    set_policy(policy_doc("local"), b, a)
    t = time.time()  # after the fills (a copy is not dropped in the instant it is made)
    assert hc(a).run_pass(t).dropped == [f0]
    assert hc(b).run_pass(t).dropped == [f1]
    assert (held(a), held(b)) == ({f1: "nvme"}, {f0: "nvme"})
    assert settled(a, t) and settled(b, t)
    objects_intact(s3_client, s3_bucket, fleet.data)
