"""A fleet's origin keeps its files: on a shared catalog (real PostgreSQL) a host copies a
bucket's file (moto) onto its own nvme instead of moving it; loads and reads use the copy
while it is current, never once the object changed; a restart (or a crash's leftovers) is
reconciled; room is made by dropping the coldest copy. On SQLite nothing of this runs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import make_settings
from tests.s3 import REGION
from tiering.catalog import Copies
from tiering.copies.hostcopies import HostCopies
from tiering.engine import Engine
from tiering.errors import Conflict, InsufficientSpace

KiB = 1 << 10


def _config(root: Path, catalog_url: str, endpoint: str, bucket: str, **nvme: Any) -> Any:
    return make_settings(
        root,
        host_id="host-a",
        catalog_url=catalog_url,
        watch=False,
        tiers=[
            {"name": "nvme", "path": root / "nvme", **nvme},
            {
                "name": "s3",
                "url": f"s3://{bucket}/m",
                "endpoint_url": endpoint,
                "region": REGION,
                "connections": 2,
            },
        ],
    ).engine_config()


@pytest.fixture
def objects(s3_client: Any, s3_bucket: str, s3_env: Any) -> dict[str, bytes]:
    data = {f"f{i}.bin": os.urandom(64 * KiB + i) for i in range(3)}
    for rel, body in data.items():
        s3_client.put_object(Bucket=s3_bucket, Key=f"m/{rel}", Body=body)
    return data


@pytest.fixture
def cfg(
    tmp_path: Path, pg_url: str, moto_endpoint: str, s3_bucket: str, objects: dict[str, bytes]
) -> Any:
    return _config(tmp_path, pg_url, moto_endpoint, s3_bucket)


@contextlib.contextmanager
def started(cfg: Any) -> Iterator[Engine]:
    e = Engine(cfg).start(scheduler=False)  # the tests run the copy planner's passes
    try:
        yield e
    finally:
        e.stop()


@pytest.fixture
def eng(cfg: Any) -> Iterator[Engine]:
    with started(cfg) as e:
        yield e


def _hc(eng: Engine) -> HostCopies:
    assert eng.host_copies is not None
    return eng.host_copies


def _copies_dir(eng: Engine) -> Path:
    root = eng.tiers.get("nvme").local_root
    assert root is not None
    return root / ".tierd-copies"


def test_a_copy_is_filled_read_kept_over_a_restart_and_never_served_stale(
    cfg: Any, eng: Engine, objects: dict[str, bytes], s3_client: Any, s3_bucket: str
) -> None:
    rec = eng.lookup("f0.bin")
    hc = _hc(eng)
    entry = hc.fill(rec.id, "nvme")
    assert (entry.tier, entry.generation) == ("nvme", rec.generation)
    assert eng.get(rec.id).tier == "s3"  # a copy, not a move: the object stays
    s3_client.head_object(Bucket=s3_bucket, Key="m/f0.bin")
    rows = Copies(eng.catalog.db).list(file_id=rec.id)
    assert [(r.host, r.location, r.generation) for r in rows] == [
        ("host-a", "nvme", rec.generation)
    ]
    content = eng.open_content(rec.id)
    assert content.source.local_file() is not None  # a local file, not ranged GETs
    assert b"".join(content.iter_range(0, content.size)) == objects["f0.bin"]
    with pytest.raises(Conflict):
        eng.migrate(rec.id, "nvme")  # a move off the origin would take it from every host

    eng.stop()
    with started(cfg) as again:
        hc2 = _hc(again)
        assert hc2.get(rec.id) is not None  # reconciled: file and row agree
        assert [p.name for p in _copies_dir(again).iterdir()] == [f"{rec.id}.{rec.generation}"]

        # The object changes; the catalog learns it (a rescan): the old copy is never served.
        s3_client.put_object(Bucket=s3_bucket, Key="m/f0.bin", Body=b"new bytes")
        again.scan()
        cur = again.get(rec.id)
        assert cur.generation != rec.generation
        assert hc2.open(cur) is None
        content = again.open_content(rec.id)
        assert content.source.local_file() is None
        assert b"".join(content.iter_range(0, content.size)) == b"new bytes"
        report = hc2.run_pass()
        assert rec.id in report.dropped
        assert list(_copies_dir(again).iterdir()) == []
        assert Copies(again.catalog.db).list(file_id=rec.id) == []


def test_a_crash_s_leftovers_are_reconciled_and_a_second_reconcile_changes_nothing(
    eng: Engine,
) -> None:
    hc = _hc(eng)
    a, b, c = (eng.lookup(f"f{i}.bin") for i in range(3))
    hc.fill(a.id, "nvme")  # a good copy: kept
    d = _copies_dir(eng)
    (d / f".{b.id}.{b.generation}.dead.tierd-tmp").write_bytes(b"half")  # killed mid-write
    (d / f"{b.id}.{b.generation}").write_bytes(b"x" * b.size)  # killed before its row
    (d / f"{a.id}.{a.generation + 7}").write_bytes(b"old")  # of another generation
    copies = Copies(eng.catalog.db)  # killed after the row, the file gone (a drop's order
    copies.record(c.id, host="host-a", location="nvme", generation=c.generation, size=c.size,
                  states=("stable",))  # fmt: skip
    first = hc.reconcile()
    assert (first.temps, first.files, first.rows, first.kept) == (1, 2, 1, 1)
    assert [p.name for p in d.iterdir()] == [f"{a.id}.{a.generation}"]
    assert [r.file_id for r in copies.list(host="host-a")] == [a.id]
    second = hc.reconcile()
    assert (second.temps, second.files, second.rows, second.kept) == (0, 0, 0, 1)


def test_room_is_made_by_dropping_the_coldest_copy(
    tmp_path: Path, pg_url: str, moto_endpoint: str, s3_bucket: str, objects: dict[str, bytes]
) -> None:
    # Room for two copies of ~64 KiB under the quota, not three.
    cfg = _config(tmp_path, pg_url, moto_endpoint, s3_bucket, quota_bytes=160 * KiB)
    with started(cfg) as eng:
        hc = _hc(eng)
        a, b, c = (eng.lookup(f"f{i}.bin") for i in range(3))
        assert eng.access is not None
        for fid, n in ((a.id, 1), (b.id, 5), (c.id, 9)):
            eng.access.record(fid, n)
        eng.access.flush()
        hc.fill(a.id, "nvme")
        hc.fill(b.id, "nvme")
        hc.fill(c.id, "nvme")  # hotter than a: a goes
        assert {e.file_id for e in hc.entries()} == {b.id, c.id}
        assert not (_copies_dir(eng) / f"{a.id}.{a.generation}").exists()
        with pytest.raises(InsufficientSpace):
            hc.fill(a.id, "nvme")  # colder than both: nothing is dropped for it
        assert {e.file_id for e in hc.entries()} == {b.id, c.id}


def test_on_sqlite_a_promotion_stays_a_move(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str, objects: dict[str, bytes]
) -> None:
    cfg = _config(tmp_path, f"sqlite:///{tmp_path / 'catalog.db'}", moto_endpoint, s3_bucket)
    with started(cfg) as eng:
        assert eng.host_copies is None
        rec = eng.lookup("f1.bin")
        eng.migrate(rec.id, "nvme")
        assert eng.get(rec.id).tier == "nvme"
        assert not _copies_dir(eng).exists()


def test_a_reserved_path_is_no_user_path(eng: Engine) -> None:
    from tiering.errors import InvalidPath

    for bad in (".tierd-copies", ".tierd-copies/1.0"):
        with pytest.raises(InvalidPath):
            eng.lookup(bad)
