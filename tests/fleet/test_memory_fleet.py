"""The memory tier on a fleet: two hosts' engines (in-process, each with a small memory tier
above its nvme) on one real PostgreSQL catalog and one bucket (moto). A host's memory ranks a
shared file by the heat policy ``promotion_heat`` names, its own or the fleet's, in the
planner's passes and when it drops a copy for room; it never plans a file on another host's
disk. Heat comes from each host's own access flushes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fleet.copy_support import KiB, fleet_config, heat, policy_doc, put_objects, set_policy
from tests.fleet.copy_support import started as _started
from tests.helpers import put
from tiering.catalog import Copies
from tiering.engine import Engine
from tiering.errors import InsufficientSpace

MiB = 1 << 20


@pytest.fixture
def objects(s3_client: Any, s3_bucket: str, s3_env: Any) -> dict[str, bytes]:
    return put_objects(s3_client, s3_bucket, n=2)


@contextlib.contextmanager
def _pair(
    tmp_path: Path, pg_url: str, endpoint: str, bucket: str, quota: int
) -> Iterator[tuple[Engine, Engine]]:
    ca, cb = (
        fleet_config(tmp_path / h, f"host-{h}", pg_url, endpoint, bucket, dirs=("nvme",),
                     memory_quota=quota)
        for h in ("a", "b")
    )  # fmt: skip
    with _started(ca) as a, _started(cb) as b:
        set_policy(policy_doc(memory=True), a, b)  # ram 1000 (+20 %: 1200), nvme 100, s3 0
        yield a, b


@pytest.fixture
def pair(
    tmp_path: Path, pg_url: str, moto_endpoint: str, s3_bucket: str, objects: dict[str, bytes]
) -> Iterator[tuple[Engine, Engine]]:
    with _pair(tmp_path, pg_url, moto_endpoint, s3_bucket, 1 * MiB) as engines:
        yield engines


def _in_memory(e: Engine) -> set[int]:
    """The files with a copy in ``e``'s memory; its catalog rows say the same."""
    assert e.memory is not None and e.db is not None
    held = {m.file_id for m in e.memory.entries()}
    rows = {r.file_id for r in Copies(e.db).list(host=e.config.host_id) if r.location == "ram"}
    assert held == rows, (held, rows)
    return held


def test_memory_follows_local_or_fleet_heat_and_never_another_host_s_disk(
    pair: tuple[Engine, Engine],
) -> None:
    a, b = pair
    f0, f1 = a.lookup("f0.bin").id, a.lookup("f1.bin").id
    own = put(b, "b-only.bin", b"x" * 4096, tier="nvme")  # on host b's disk: a cannot read it
    assert own.host == "host-b"
    heat(b, {f0: 1500, own.id: 5000})  # read on b
    heat(a, {f1: 1500})  # read on a
    assert a.memory is not None and b.memory is not None

    # local (the default): a's memory takes what a reads, b's what b reads.
    t = time.time()
    assert [f.file_id for f in a.memory.plan(t).fills] == [f1]
    report = a.memory.run_pass()
    assert (report.filled, report.failed) == ([f1], [])
    assert sorted(b.memory.run_pass().filled) == sorted([f0, own.id])
    assert _in_memory(a) == {f1}

    # fleet: a shared file hot anywhere comes into a's memory; b's own file still does not.
    set_policy(policy_doc("fleet", memory=True), a, b)
    assert [f.file_id for f in a.memory.plan().fills] == [f0]
    report = a.memory.run_pass()
    assert (report.filled, report.failed) == ([f0], [])
    assert _in_memory(a) == {f0, f1}
    assert not a.memory.plan()

    # local again: a drops the copy only b reads.
    set_policy(policy_doc("local", memory=True), b, a)
    report = a.memory.run_pass()
    assert (report.dropped, report.filled) == ([f0], [])
    assert [d.code for d in report.plan.drops] == ["cold"]
    assert _in_memory(a) == {f1}
    assert not a.memory.plan()


def test_a_fill_drops_for_room_by_the_heat_policy_names(
    tmp_path: Path, pg_url: str, moto_endpoint: str, s3_bucket: str, objects: dict[str, bytes]
) -> None:
    # Room for one copy of ~64 KiB. f1: 1500 on a. f0: 500 on a and 3000 on b (fleet 3500).
    with _pair(tmp_path, pg_url, moto_endpoint, s3_bucket, 100 * KiB) as (a, b):
        f0, f1 = a.lookup("f0.bin").id, a.lookup("f1.bin").id
        heat(a, {f1: 1500, f0: 500})
        heat(b, {f0: 3000})
        assert a.memory is not None
        a.memory.fill(f1)
        with pytest.raises(InsufficientSpace):
            a.memory.fill(f0)  # local: f0 is 500 here, colder than f1's 1500: f1 stays
        assert _in_memory(a) == {f1}

        set_policy(policy_doc("fleet", memory=True), a, b)
        a.memory.fill(f0)  # fleet: f0 is 3500, hotter than f1: f1 makes room
        assert _in_memory(a) == {f0}
