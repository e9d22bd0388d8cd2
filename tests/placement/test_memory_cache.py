"""The memory tier bound to the engine: fills recorded in the catalog's copies table, loads
served from memory (source ``memory``), eviction, heat placing files into it through the
scheduler, and every way a copy must go: a file changed behind tierd's back, moved, deleted,
memory pressure, a restart. Real tiers in temp dirs, a real Alembic-built catalog, real loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from app.settings import Settings
from tests.conftest import disk_snapshot, wait_for
from tests.helpers import assert_invariants, put
from tests.placement.memory_support import (
    MiB,
    assert_catalog_never_names_memory,
    cached_ids,
    copy_rows,
    heat_up,
    memory_settings,
)
from tiering.catalog import Copies, Database
from tiering.engine import Engine
from tiering.errors import CacheOnlyTier, InsufficientSpace, IntegrityError, TierUnavailable
from tiering.serving import Lease, Loader, LoaderConfig

KiB = 1 << 10


@pytest.fixture
def msettings(tmp_path: Path) -> Settings:
    return memory_settings(tmp_path / "data")


@pytest.fixture
def eng(msettings: Settings) -> Iterator[Engine]:
    with Engine(msettings.engine_config()) as e:
        yield e


@pytest.fixture
def loader(eng: Engine) -> Iterator[Loader]:
    ld = Loader(eng, LoaderConfig(cpu_budget_bytes=64 * MiB)).start()
    yield ld
    ld.stop()


def loaded(ld: Loader, lease: Lease) -> bytes:
    out = np.asarray(lease.buffer.array()[lease.offset : lease.offset + lease.nbytes]).tobytes()
    ld.leases.release(lease.id)
    return out


def test_fill_then_loads_are_served_from_memory(eng: Engine, loader: Loader) -> None:
    data = os.urandom(3 * MiB + 17)
    rec = put(eng, "models/m/w.bin", data, tier="hdd")
    assert eng.memory is not None
    entry = eng.memory.fill(rec.id)
    assert entry.pinned_memory and entry.checksum == rec.checksum
    [row] = copy_rows(eng)
    assert (row.file_id, row.host, row.location, row.generation, row.size) == (
        rec.id,
        "host-a",
        "ram",
        rec.generation,
        len(data),
    )
    whole = loader.load(rec.id, device="cpu")
    assert whole.report is not None and whole.report.source == "memory"
    assert loaded(loader, whole) == data
    part = loader.load("models/m/w.bin", offset=1000, length=5000, device="cpu")
    assert part.report is not None and part.report.source == "memory"
    assert loaded(loader, part) == data[1000:6000]
    assert entry.refs == 0  # every load let go of the copy when its read ended
    assert eng.catalog.get(rec.id).tier == "hdd"  # the file's home is where it was
    assert_catalog_never_names_memory(eng)


def test_without_a_copy_loads_read_the_tier(eng: Engine, loader: Loader) -> None:
    rec = put(eng, "a.bin", b"abc" * 1000)
    lease = loader.load(rec.id, device="cpu")
    assert lease.report is not None and lease.report.source != "memory"
    assert loaded(loader, lease) == b"abc" * 1000


def test_heat_fills_the_memory_tier_through_the_scheduler(eng: Engine, loader: Loader) -> None:
    hot = put(eng, "hot.bin", os.urandom(200 * KiB), tier="ssd")
    warm = put(eng, "warm.bin", os.urandom(10 * KiB), tier="nvme")
    heat_up(eng, hot.id, 1000)  # ≥ 200 × 1.2: belongs in ram (its home stays a storage tier)
    heat_up(eng, warm.id, 150)  # nvme's, not ram's
    doc = eng.policy().document() | {"interval_s": 0.05}
    eng.set_policy(doc)
    assert eng.memory is not None
    wait_for(lambda: cached_ids(eng) == [hot.id], what="the hot file copied into memory")
    lease = loader.load(hot.id, device="cpu")
    assert lease.report is not None and lease.report.source == "memory"
    loaded(loader, lease)
    # The storage plan is the one it would be without a memory tier: no move names ram.
    assert all(m.dst != "ram" for m in eng.plan())
    assert eng.explain(hot.id).wanted_tier == "nvme"
    assert_catalog_never_names_memory(eng)


def test_eviction_under_the_quota_and_its_watermarks(tmp_path: Path) -> None:
    settings = memory_settings(tmp_path / "data", quota=MiB)
    with Engine(settings.engine_config()) as eng:
        assert eng.memory is not None
        # The scheduler off: this test runs the cache's passes itself, one at a time.
        eng.set_policy(eng.policy().document() | {"enabled": False})
        recs = [put(eng, f"f{i}", bytes([i]) * (300 * KiB)) for i in range(4)]
        for i, r in enumerate(recs):
            heat_up(eng, r.id, 1000 * (i + 1))
        report = eng.memory.run_pass()
        # Fills stop at the low watermark (80 % of 1 MiB): the two hottest.
        assert report.filled == [recs[3].id, recs[2].id]
        assert cached_ids(eng) == sorted([recs[3].id, recs[2].id])
        assert not eng.memory.run_pass().plan  # and planning again changes nothing
        # An explicit fill past the quota takes the place of colder copies only...
        heat_up(eng, recs[1].id, 5000)  # now hotter than recs[2]
        eng.memory.fill(recs[1].id)
        assert cached_ids(eng) == sorted([recs[1].id, recs[3].id, recs[2].id])
        with pytest.raises(InsufficientSpace):
            eng.memory.fill(recs[0].id)  # the coldest of all: nothing colder to drop
        assert eng.memory.tier.used_bytes <= MiB
        # A lower quota in the policy: past its high watermark (630 KiB) the copies are kept
        # hottest first while they fit under the low one (560 KiB); the others go.
        doc = eng.policy().document()
        doc["tiers"]["ram"]["quota_bytes"] = 700 * KiB
        eng.set_policy(doc)
        report = eng.memory.run_pass()
        drops = [(d.file_id, d.code) for d in report.plan.drops]
        assert drops == [(recs[3].id, "watermark"), (recs[2].id, "watermark")]
        assert cached_ids(eng) == [recs[1].id]
        assert eng.memory.tier.used_bytes <= 0.8 * 700 * KiB
        assert sorted(r.file_id for r in copy_rows(eng)) == cached_ids(eng)
        assert_invariants(eng, {f"f{i}": bytes([i]) * (300 * KiB) for i in range(4)})


def test_a_file_rewritten_behind_tierds_back_is_never_served_from_memory(
    eng: Engine, loader: Loader
) -> None:
    old, new = b"A" * (64 * KiB), b"B" * (64 * KiB)
    rec = put(eng, "w.bin", old)
    assert eng.memory is not None
    eng.memory.fill(rec.id)
    path = eng.tiers.get("nvme").local_root / "w.bin"  # type: ignore[operator]
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, new, 0)  # same size, same inode: only the time tells
    finally:
        os.close(fd)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    lease = loader.load(rec.id, device="cpu")
    assert lease.report is not None and lease.report.source != "memory"
    assert loaded(loader, lease) == new
    assert cached_ids(eng) == [] and copy_rows(eng) == []  # the stale copy went at that look
    # Nor is it copied in again while the catalog's checksum is the old bytes'.
    with pytest.raises(IntegrityError, match="behind tierd's back"):
        eng.memory.fill(rec.id)
    assert copy_rows(eng) == []


def test_a_moved_file_is_not_served_from_its_old_copy(eng: Engine, loader: Loader) -> None:
    data = os.urandom(100 * KiB)
    rec = put(eng, "m.bin", data)
    assert eng.memory is not None
    eng.memory.fill(rec.id)
    eng.migrate(rec.id, "hdd")  # the switch bumps the generation: the copy is stale
    lease = loader.load(rec.id, device="cpu")
    assert lease.report is not None and lease.report.source != "memory"
    assert loaded(loader, lease) == data
    assert cached_ids(eng) == [] and copy_rows(eng) == []
    eng.memory.fill(rec.id)  # copied again from its new home
    assert [r.generation for r in copy_rows(eng)] == [eng.get(rec.id).generation]


def test_delete_drops_the_copy(eng: Engine) -> None:
    rec = put(eng, "d.bin", b"x" * 1000)
    assert eng.memory is not None
    eng.memory.fill(rec.id)
    eng.delete(rec.id)
    assert cached_ids(eng) == [] and copy_rows(eng) == []


def test_the_catalog_never_records_a_memory_only_file(
    eng: Engine, msettings: Settings, loader: Loader
) -> None:
    rec = put(eng, "models/m/model.safetensors", b"\0" * 100)
    assert eng.memory is not None
    eng.memory.fill(rec.id)
    before = [(r.id, r.tier, r.generation, r.pinned_tier) for r in eng.catalog.all()]
    snap = disk_snapshot(msettings.data_dir)
    attempts: list[Callable[[], object]] = [
        lambda: eng.begin_upload("new.bin", tier="ram"),
        lambda: eng.migrate(rec.id, "ram"),
        lambda: eng.submit_move(rec.id, "ram"),
        lambda: eng.pin(rec.id, "ram"),
        lambda: loader.models.pin("models/m", "ram"),
    ]
    for attempt in attempts:
        with pytest.raises(CacheOnlyTier, match="holds cached copies"):
            attempt()
    assert [(r.id, r.tier, r.generation, r.pinned_tier) for r in eng.catalog.all()] == before
    assert disk_snapshot(msettings.data_dir) == snap
    assert eng.journal.list() == []
    assert_catalog_never_names_memory(eng)


def test_pressure_drops_the_coldest_and_never_under_a_load(eng: Engine) -> None:
    assert eng.memory is not None
    recs = [put(eng, f"p{i}", bytes([i]) * (100 * KiB)) for i in range(3)]
    for i, r in enumerate(recs):
        heat_up(eng, r.id, 10 * (i + 1))
        eng.memory.fill(r.id)
    held = eng.memory.tier.acquire(recs[0].id, recs[0].generation)  # a load reads the coldest
    assert held is not None
    eng.memory.tier.floor_bytes = 1 << 62  # every host is now short of memory
    dropped = eng.memory.relieve_pressure()
    assert sorted(e.file_id for e in dropped) == [recs[1].id, recs[2].id]
    assert cached_ids(eng) == [recs[0].id]
    assert eng.memory.tier.drop(recs[0].id, "cold")  # deferred: the load still reads it
    assert held.view().tobytes() == bytes([0]) * (100 * KiB)
    eng.memory.tier.release(held)
    assert held.alloc.array is None and eng.memory.tier.used_bytes == 0
    assert copy_rows(eng) == []
    assert_invariants(eng, {f"p{i}": bytes([i]) * (100 * KiB) for i in range(3)})


def test_restart_loses_nothing_and_starting_twice_changes_nothing(msettings: Settings) -> None:
    files = {f"r{i}.bin": os.urandom(50 * KiB + i) for i in range(3)}
    with Engine(msettings.engine_config()) as eng:
        recs = [put(eng, p, d) for p, d in files.items()]
        assert eng.memory is not None
        for r in recs:
            eng.memory.fill(r.id)
        assert len(copy_rows(eng)) == 3
    # A clean stop forgets its copies. A crash (kill -9, OOM) leaves rows behind: make them,
    # as such a process would have, beside a row of another host sharing the catalog.
    db = Database(msettings.catalog_url)
    for r, host in zip(recs, ["host-a", "host-a", "host-b"], strict=True):
        Copies(db).record(
            r.id, host=host, location="ram", generation=r.generation, size=r.size, states=["stable"]
        )
    db.dispose()
    seen = []
    for _ in range(2):
        with Engine(msettings.engine_config()) as eng:
            assert cached_ids(eng) == []
            # This host's memory rows are gone; another host's copy is its own business.
            assert [(r.file_id, r.host) for r in copy_rows(eng)] == [(recs[2].id, "host-b")]
            assert_invariants(eng, files)
            seen.append([(r.id, r.tier, r.generation, r.checksum) for r in eng.catalog.all()])
            ld = Loader(eng).start()
            try:
                for p, d in files.items():
                    lease = ld.load(p, device="cpu")
                    assert lease.report is not None and lease.report.source != "memory"
                    assert loaded(ld, lease) == d
            finally:
                ld.stop()
    assert seen[0] == seen[1]  # the second start changed nothing


def test_a_memory_tier_bigger_than_the_host_is_refused_at_start(tmp_path: Path) -> None:
    settings = memory_settings(tmp_path / "data", quota=1 << 60)
    (tmp_path / "data" / "catalog.db").unlink()  # no catalog yet: the start must not make one
    eng = Engine(settings.engine_config())
    with pytest.raises(TierUnavailable, match="over this host's memory"):
        eng.start()
    assert not (tmp_path / "data" / "catalog.db").exists()  # refused before anything changed
