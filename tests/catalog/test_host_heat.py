"""Each host's own heat of shared files (``host_heat``), on SQLite and PostgreSQL: two hosts'
access flushes on one catalog add up per host and in the file's (fleet) heat, decay alike, skip
files on a host's own tier, and the storage planner lifts a shared file by this host's heat or
the fleet's, as policy ``promotion_heat`` says."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.catalog.conftest import run_sql
from tiering.catalog import Catalog, Database, FileRecord, NewFile, decay
from tiering.catalog.db import upgrade
from tiering.catalog.heat import HostHeats
from tiering.placement import Policy, TierState, plan
from tiering.placement.fleetheat import LocalHeat, heat_for_promotion, local_heat

HL = 100.0
T0 = 1_800_000_000.0


@dataclass
class Fleet:
    url: str
    a: Catalog
    b: Catalog
    shared: FileRecord  # on the object store: no host's
    own: FileRecord  # on host a's nvme


@pytest.fixture
def fleet(empty_catalog_url: str) -> Iterator[Fleet]:
    url = empty_catalog_url
    upgrade(url)
    dbs = [Database(url, host=h, shared_tiers=["s3"]) for h in ("host-a", "host-b")]
    a, b = Catalog(dbs[0]), Catalog(dbs[1])
    shared, own = a.upsert_many(
        [NewFile("m/model.bin", "s3", 10, 1, "c1"), NewFile("m/own.bin", "nvme", 10, 1, "c2")],
        now=T0,
    )
    assert shared is not None and own is not None
    yield Fleet(url, a, b, shared, own)
    for db in dbs:
        db.dispose()


def _heats(cat: Catalog, fid: int, now: float) -> dict[str, tuple[float, int]]:
    rows = HostHeats(cat.db).of([fid], now=now, half_life_s=HL).get(fid, {})
    return {h: (round(r.heat, 9), r.access_count) for h, r in rows.items()}


def test_flushes_add_up_per_host_and_in_the_sum(fleet: Fleet) -> None:
    s, own = fleet.shared.id, fleet.own.id
    fleet.a.record_accesses({s: 3, own: 5}, now=T0, half_life_s=HL)
    fleet.b.record_accesses({s: 1}, now=T0, half_life_s=HL)
    fleet.a.record_accesses({s: 2}, now=T0 + HL, half_life_s=HL)  # a's 3 halved, plus 2

    later = T0 + HL
    assert _heats(fleet.a, s, later) == {"host-a": (3.5, 5), "host-b": (0.5, 1)}
    assert list(_heats(fleet.b, s, later)) == ["host-a", "host-b"]  # hottest first
    rec = fleet.b.get(s)
    assert rec.access_count == 6
    fleet_heat = decay(rec.heat, rec.heat_at, later, HL)
    assert fleet_heat == pytest.approx(3.5 + 0.5)  # decay is linear: the sum of the hosts'
    # Another half-life on: every heat halves, the counts stay.
    assert _heats(fleet.a, s, later + HL) == {"host-a": (1.75, 5), "host-b": (0.25, 1)}
    # A file on host a's own tier gets no host rows: only a reads it, its heat is a's.
    assert _heats(fleet.a, own, later) == {}
    assert fleet.a.get(own).access_count == 5
    assert HostHeats(fleet.a.db).raw("host-b") == {s: (1.0, T0)}


def test_a_flush_naming_a_deleted_file_writes_nothing_for_it(fleet: Fleet) -> None:
    s = fleet.shared.id
    fleet.b.record_accesses({s: 1}, now=T0, half_life_s=HL)
    assert fleet.a.delete(s)
    assert run_sql(fleet.url, "SELECT count(*) FROM host_heat") == [(0,)]  # gone with the file
    fleet.a.record_accesses({s: 4, fleet.own.id: 1}, now=T0 + 1, half_life_s=HL)
    assert run_sql(fleet.url, "SELECT count(*) FROM host_heat") == [(0,)]
    assert fleet.a.get(fleet.own.id).access_count == 1


def test_a_catalog_without_a_host_id_keeps_no_host_rows(fleet: Fleet) -> None:
    db = Database(fleet.url, shared_tiers=["s3"])
    try:
        Catalog(db).record_accesses({fleet.shared.id: 2}, now=T0, half_life_s=HL)
    finally:
        db.dispose()
    assert run_sql(fleet.url, "SELECT count(*) FROM host_heat") == [(0,)]
    assert fleet.a.get(fleet.shared.id).access_count == 2


def _policy(promotion_heat: str) -> Policy:
    doc = {
        "tiers": {"nvme": {"min_heat": 10}, "s3": {"min_heat": 0}},
        "half_life_s": HL,
        "min_age_s": 0,
        "hysteresis": 0.2,
        "promotion_heat": promotion_heat,
    }
    return Policy.parse(doc, ["nvme", "s3"])


def _promoted(cat: Catalog, promotion_heat: str, now: float) -> list[str]:
    """The relpaths the storage planner lifts off the object store for ``cat``'s host."""
    local = LocalHeat(frozenset({"s3"}), HostHeats(cat.db).raw(cat.db.host or ""))
    usage = {"nvme": TierState("nvme", 10), "s3": TierState("s3", 10)}
    moves = plan(cat.actionable(), _policy(promotion_heat), usage, now, local=local)
    return [m.relpath for m in moves if (m.src, m.dst) == ("s3", "nvme")]


def test_the_planner_promotes_by_local_or_fleet_heat_as_the_policy_says(fleet: Fleet) -> None:
    # Host b reads the shared file 8 times, host a 7 times: 15 together, over nvme's 10 (+20%).
    s = fleet.shared.id
    fleet.a.record_accesses({s: 7}, now=T0, half_life_s=HL)
    fleet.b.record_accesses({s: 8}, now=T0, half_life_s=HL)
    now = T0 + 1
    assert _promoted(fleet.a, "fleet", now) == ["m/model.bin"]
    assert _promoted(fleet.b, "fleet", now) == ["m/model.bin"]
    assert _promoted(fleet.a, "local", now) == []
    assert _promoted(fleet.b, "local", now) == []
    # The reverse: b alone reads it past the threshold, so b lifts it by its own heat, a not.
    fleet.b.record_accesses({s: 6}, now=now, half_life_s=HL)
    assert _promoted(fleet.b, "local", now) == ["m/model.bin"]
    assert _promoted(fleet.a, "local", now) == []
    # A file on a host's own tier is planned by its one heat, whatever the knob.
    rec = fleet.a.get(fleet.own.id)
    local = LocalHeat(frozenset({"s3"}), {})
    for knob in ("local", "fleet"):
        assert heat_for_promotion(_policy(knob), rec, now, local) == 0.0
    fleet.a.record_accesses({fleet.own.id: 4}, now=now, half_life_s=HL)
    rec = fleet.a.get(fleet.own.id)
    assert heat_for_promotion(_policy("local"), rec, now, local) == pytest.approx(4.0)


def test_local_heat_is_read_only_where_hosts_share_the_catalog(
    fleet: Fleet, catalog_backend: str
) -> None:
    s = fleet.shared.id
    fleet.a.record_accesses({s: 2}, now=T0, half_life_s=HL)
    fleet.b.record_accesses({s: 9}, now=T0, half_life_s=HL)
    local = local_heat(fleet.a)
    rec = fleet.a.get(s)
    heat = heat_for_promotion(_policy("local"), rec, T0 + HL, local)
    if catalog_backend == "sqlite":
        # One host ever writes a SQLite catalog: all of a file's heat is that host's.
        assert local is None
        assert heat == pytest.approx(5.5)
    else:
        assert local is not None and local.rows == {s: (2.0, T0)}
        assert heat == pytest.approx(1.0)
        assert heat_for_promotion(_policy("fleet"), rec, T0 + HL, local) == pytest.approx(5.5)
