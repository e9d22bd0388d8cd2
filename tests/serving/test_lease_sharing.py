"""Several leases over one buffer: charged once, freed with the last holder, never revived.

The lease table over real shared-memory buffers, with a clock the test turns.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tiering.errors import InsufficientSpace, InvalidInput
from tiering.io import Device
from tiering.io.bufferpool import BufferPool
from tiering.io.buffers import alloc_size
from tiering.serving.leases import Holding, Lease, LeaseSpec, LeaseTable

CPU = Device("cpu")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def table(clock: Clock) -> Iterator[LeaseTable]:
    t = LeaseTable(lambda d: 3 * 4096, clock=clock, pool=BufferPool(max_idle_bytes=0))
    yield t
    t.stop()


def _grant(table: LeaseTable, n: int = 100, *, read_only: bool = True, ttl: float = 60) -> Lease:
    res = table.reserve(CPU, alloc_size(CPU, n))
    res.attach(table.pool.get(CPU, n))
    spec = LeaseSpec(n, "uint8", (n,), "load", (1,), ttl_s=ttl)
    return table.grant(res, spec, read_only=read_only)


def _share(table: LeaseTable, holding: Holding, *, ttl: float = 60) -> Lease | None:
    return table.share(holding, LeaseSpec(10, "uint8", (10,), "load", (1,), ttl_s=ttl, offset=8))


def _exists(lease: Lease) -> bool:
    return os.path.exists(f"/dev/shm/{lease.handle()['name']}")


def test_shares_are_charged_once_and_freed_with_the_last(table: LeaseTable) -> None:
    first = _grant(table)
    assert first.holding is not None
    gone: list[Holding] = []
    assert table.watch(first.holding, gone.append)
    a, b = _share(table, first.holding), _share(table, first.holding)
    assert a is not None and b is not None
    assert a.buffer is first.buffer and a.reused and a.read_only and not first.reused
    assert a.handle()["name"] == first.handle()["name"] and a.handle()["offset"] == 8
    assert a.handle()["read_only"] is True
    assert table.leased_bytes() == {"cpu": 4096}
    # The budget holds two more allocations: shares took none of it.
    for _ in range(2):
        _grant(table)
    with pytest.raises(InsufficientSpace):
        _grant(table)
    table.release(first.id)
    table.release(a.id)
    assert gone == [] and _exists(b)
    table.release(b.id)
    assert gone == [first.holding] and not _exists(b)
    assert table.leased_bytes() == {"cpu": 2 * 4096}
    # Never revived: a later share of the holding gets nothing.
    assert _share(table, first.holding) is None
    assert not table.hold(first.holding) and not table.watch(first.holding, gone.append)


def test_a_pin_keeps_the_buffer_past_its_leases(table: LeaseTable) -> None:
    lease = _grant(table)
    assert lease.holding is not None and table.hold(lease.holding)
    table.release(lease.id)
    assert _exists(lease) and table.leased_bytes() == {"cpu": 4096}
    table.unhold(lease.holding)
    assert not _exists(lease) and table.leased_bytes() == {"cpu": 0}


def test_expiry_frees_only_the_expired_shares(table: LeaseTable, clock: Clock) -> None:
    lease = _grant(table, ttl=10)
    assert lease.holding is not None
    late = _share(table, lease.holding, ttl=100)
    assert late is not None
    clock.now += 50
    assert table.reap() == 1
    assert [x.id for x in table.all()] == [late.id] and _exists(late)
    clock.now += 100
    assert table.reap() == 1
    assert not _exists(late) and table.leased_bytes() == {"cpu": 0}


def test_free_all_frees_a_shared_buffer_once(table: LeaseTable) -> None:
    lease = _grant(table)
    assert lease.holding is not None
    calls: list[Holding] = []
    table.watch(lease.holding, calls.append)
    for _ in range(3):
        _share(table, lease.holding)
    assert table.free_all() == 4
    assert calls == [lease.holding] and table.leased_bytes() == {"cpu": 0}


def test_a_failing_callback_still_frees(table: LeaseTable) -> None:
    lease = _grant(table)
    assert lease.holding is not None

    def boom(_h: Holding) -> None:
        raise RuntimeError("boom")

    table.watch(lease.holding, boom)
    table.release(lease.id)
    assert not _exists(lease) and table.leased_bytes() == {"cpu": 0}


def test_a_share_outside_the_allocation_is_refused(table: LeaseTable) -> None:
    lease = _grant(table)
    assert lease.holding is not None
    with pytest.raises(InvalidInput):
        table.share(lease.holding, LeaseSpec(4096, "uint8", (4096,), "load", (1,), offset=1))
    assert len(table.all()) == 1
