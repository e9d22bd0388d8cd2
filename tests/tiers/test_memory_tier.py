"""The memory tier on its own: pinned allocations, fills from a real directory tier, the quota
and its eviction, drops deferred while a load holds a copy, memory pressure, and the host's
budget. (Bound to the catalog and the loads: tests/placement/test_memory_cache.py.)"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import checksum
from tiering.config import TierConfig
from tiering.errors import FileBusy, InsufficientSpace, IntegrityError
from tiering.tiers import DirectoryTier, FillCancelled, MemoryEntry, MemoryTier, Tiers, _memfill
from tiering.tiers._pinned import allocate, default_floor, meminfo

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.fixture
def disk(tmp_path: Path) -> DirectoryTier:
    tier = DirectoryTier(TierConfig("nvme", tmp_path / "nvme"), 0)
    tier.check()
    return tier


def write(disk: DirectoryTier, relpath: str, data: bytes) -> None:
    with disk.writer(relpath) as w:
        w.write(data)
        w.publish()


def memory(quota: int, **kwargs: object) -> MemoryTier:
    dropped: list[tuple[int, str]] = []
    tier = MemoryTier(
        TierConfig("ram", quota_bytes=quota, kind="memory"),
        floor_bytes=0,
        on_drop=lambda e, why: dropped.append((e.file_id, why)),
        **kwargs,  # type: ignore[arg-type]
    )
    tier.dropped_log = dropped  # type: ignore[attr-defined]
    return tier


def fill(tier: MemoryTier, disk: DirectoryTier, file_id: int, relpath: str) -> MemoryEntry:
    st = disk.stat(relpath)
    assert st is not None
    entry = tier.reserve(file_id, 0, st.size)
    try:
        with disk.open(relpath) as src:
            tier.fill(entry, src)
    except BaseException:
        tier.abort(entry)
        raise
    return tier.commit(entry)


@pytest.mark.parametrize("size", [0, 1, 199, 4 * KiB, 3 * MiB + 5])
def test_fill_copies_the_file_into_pinned_memory(disk: DirectoryTier, size: int) -> None:
    data = os.urandom(size)
    write(disk, "a/b.bin", data)
    tier = memory(16 * MiB)
    e = fill(tier, disk, 1, "a/b.bin")
    assert e.checksum == checksum(data)
    now = disk.stat("a/b.bin")
    assert e.stat is not None and now is not None and e.stat.same_file(now)
    assert e.pinned_memory  # mlock'd here (root holds CAP_IPC_LOCK); cudaHostAlloc on a GPU host
    assert e.view().tobytes() == data
    with pytest.raises(ValueError):
        e.view()[:1] = 0  # read-only for everyone but the fill
    assert tier.held_bytes == tier.used_bytes == size and [x.file_id for x in tier.entries()] == [1]


def test_parallel_fill_of_a_large_file_hashes_in_order(
    disk: DirectoryTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The threaded path, on a file a few chunks long (as a 64 MiB+ file would take it).
    monkeypatch.setattr(_memfill, "PARALLEL_MIN", 0)
    data = os.urandom(5 * MiB + 3)
    write(disk, "big.bin", data)
    out = np.empty(len(data), np.uint8)
    with disk.open("big.bin") as src:
        got = _memfill.read_whole(src, out, chunk=256 * KiB, threads=4)
    assert got == checksum(data) and out.tobytes() == data


def test_a_file_that_shrank_during_the_fill_is_refused(disk: DirectoryTier) -> None:
    write(disk, "f", b"x" * 1000)
    tier = memory(MiB)
    entry = tier.reserve(1, 0, 2000)  # the catalog's size: larger than the file is now
    with disk.open("f") as src, pytest.raises(IntegrityError):
        tier.fill(entry, src)
    tier.abort(entry)
    assert tier.used_bytes == 0 and tier.entries() == []


def test_cancel_stops_a_fill_between_chunks(disk: DirectoryTier) -> None:
    write(disk, "f", os.urandom(MiB))
    tier = memory(2 * MiB)
    entry = tier.reserve(1, 0, MiB)
    cancel = threading.Event()
    cancel.set()
    with disk.open("f") as src, pytest.raises(FillCancelled):
        tier.fill(entry, src, cancel=cancel)
    tier.abort(entry)
    assert tier.used_bytes == 0


def test_quota_evicts_least_recently_used_unheld_copies(disk: DirectoryTier) -> None:
    for i in range(1, 5):
        write(disk, f"f{i}", bytes([i]) * (300 * KiB))
    tier = memory(MiB)
    for i in (1, 2, 3):
        fill(tier, disk, i, f"f{i}")
    held = tier.acquire(1, 0)  # used last, and held by a load
    assert held is not None
    fill(tier, disk, 4, "f4")  # 1.2 MiB > quota: one must go; 1 is held, 2 is the oldest
    assert sorted(e.file_id for e in tier.entries()) == [1, 3, 4]
    assert tier.dropped_log == [(2, "evicted")]  # type: ignore[attr-defined]
    assert tier.used_bytes <= tier.quota_bytes
    tier.release(held)


def test_a_fill_that_cannot_make_room_evicts_nothing(disk: DirectoryTier) -> None:
    for i in (1, 2):
        write(disk, f"f{i}", bytes([i]) * (400 * KiB))
    tier = memory(MiB)
    fill(tier, disk, 1, "f1")
    fill(tier, disk, 2, "f2")
    heat = {1: 50.0, 2: 5.0}
    # Only copies colder than the newcomer may go: 2 is (5 < 10), 1 is not, and 2 alone is
    # not enough for 700 KiB, so nothing is dropped and the fill is refused.
    with pytest.raises(InsufficientSpace):
        tier.reserve(3, 0, 700 * KiB, order=lambda e: heat[e.file_id], colder_than=10.0)
    assert sorted(e.file_id for e in tier.entries()) == [1, 2]
    with pytest.raises(InsufficientSpace):
        tier.reserve(3, 0, 2 * MiB)  # larger than the quota
    assert tier.used_bytes == 800 * KiB


def test_a_second_fill_of_the_same_file_is_busy(disk: DirectoryTier) -> None:
    tier = memory(MiB)
    entry = tier.reserve(1, 0, 10)
    assert tier.filling(1) is not None
    with pytest.raises(FileBusy):
        tier.reserve(1, 0, 10)
    tier.abort(entry)
    assert tier.filling(1) is None and tier.used_bytes == 0


def test_drop_under_a_load_is_deferred_until_release(disk: DirectoryTier) -> None:
    data = os.urandom(100 * KiB)
    write(disk, "f", data)
    tier = memory(MiB)
    fill(tier, disk, 7, "f")
    e = tier.acquire(7, 0)
    assert e is not None
    view = e.view()
    assert tier.drop(7, "cold")
    assert tier.acquire(7, 0) is None  # hidden at once from new loads...
    assert view.tobytes() == data  # ...but the load holding it reads on, undisturbed
    assert tier.used_bytes == len(data) and e.alloc.array is not None
    tier.release(e)
    assert e.alloc.array is None and tier.used_bytes == 0  # freed at the last release


def test_a_copy_of_another_generation_is_stale(disk: DirectoryTier) -> None:
    write(disk, "f", b"abc")
    tier = memory(MiB)
    fill(tier, disk, 1, "f")  # generation 0
    assert tier.acquire(1, 1) is None
    assert tier.entries() == [] and tier.dropped_log == [(1, "stale")]  # type: ignore[attr-defined]


def test_pressure_drops_the_coldest_unheld_copies(disk: DirectoryTier) -> None:
    for i in (1, 2, 3):
        write(disk, f"f{i}", bytes([i]) * (100 * KiB))
    tier = memory(MiB)
    for i in (1, 2, 3):
        fill(tier, disk, i, f"f{i}")
    held = tier.acquire(1, 0)
    assert held is not None
    assert tier.pressure() == 0  # floor 0: no pressure
    tier.floor_bytes = 1 << 62  # more than any host has available: pressure
    assert tier.pressure() > 0
    heat = {1: 0.0, 2: 9.0, 3: 1.0}
    dropped = tier.relieve(150 * KiB, order=lambda e: heat[e.file_id])
    # 1 is coldest but held; then 3, then 2 until 150 KiB are freed.
    assert [e.file_id for e in dropped] == [3, 2]
    assert [e.file_id for e in tier.entries()] == [1]
    with pytest.raises(InsufficientSpace, match="host memory is low"):
        tier.reserve(4, 0, 10)  # and no fill is taken under the floor
    tier.release(held)


def test_close_drops_everything_and_refuses_fills_in_flight(disk: DirectoryTier) -> None:
    write(disk, "f", b"x" * 10)
    tier = memory(MiB)
    fill(tier, disk, 1, "f")
    entry = tier.reserve(2, 0, 10)
    with disk.open("f") as src:
        tier.fill(entry, src)
    tier.close()
    with pytest.raises(FillCancelled):
        tier.commit(entry)
    assert tier.entries() == [] and tier.used_bytes == 0
    tier.reopen()
    fill(tier, disk, 1, "f")
    assert tier.held_bytes == 10


def test_the_memory_tier_is_no_storage_tier(tmp_path: Path) -> None:
    from tiering.errors import CacheOnlyTier

    tiers = Tiers([TierConfig("nvme", tmp_path / "n")], caches=["ram"])
    assert "ram" not in tiers and [t.name for t in tiers] == ["nvme"]
    with pytest.raises(CacheOnlyTier, match="holds cached copies"):
        tiers.get("ram")
    with pytest.raises(ValueError, match="memory tier"):
        Tiers([TierConfig("ram", quota_bytes=1, kind="memory")])


def test_mlock_allocation_is_freed(tmp_path: Path) -> None:
    a = allocate(3 * MiB + 1, "mlock")
    assert a.pinned and a.array is not None and a.array.nbytes == 3 * MiB + 1
    a.array[:] = 7
    a.free()
    a.free()  # idempotent
    assert a.array is None and not a.pinned


def test_meminfo_and_the_default_floor(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       32000000 kB\nMemAvailable:    1000 kB\nHugePages_Total: 0\n")
    info = meminfo(f)
    assert info == {"MemTotal": 32_768_000_000, "MemAvailable": 1_024_000, "HugePages_Total": 0}
    assert default_floor(info["MemTotal"]) == 32_768_000_000 // 20  # 5 % of a large host
    assert default_floor(8 * GiB) == GiB  # at least 1 GiB on a small one
    assert meminfo(tmp_path / "absent") == {}
