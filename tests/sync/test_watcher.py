"""Live directory sync through the REST API of a running app, with the real watcher.

Every wait is for a condition, with a generous bound; nothing sleeps in place of waiting.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import time
from pathlib import Path

import pytest

from tests.conftest import LiveServer, make_settings, wait_for

SETTLE = 0.3


def lookup(c, path: str):
    r = c.get("/v1/files/lookup", params={"path": path})
    return r.json() if r.status_code == 200 else None


def watcher_status(c) -> dict:
    return c.get("/readyz").json()["checks"]["watcher"]


@pytest.fixture
def srv(data_dir: Path):
    settings = make_settings(data_dir, watch_settle_s=SETTLE)
    with LiveServer(settings) as s:
        yield s


@pytest.fixture
def c(srv: LiveServer):
    with srv.client() as client:
        yield client


def test_created_file_is_adopted_after_it_settles(c, data_dir: Path) -> None:
    status = watcher_status(c)
    assert status["healthy"] and status["backend"] == "inotify"
    p = data_dir / "ssd/incoming/model.bin"
    p.parent.mkdir(parents=True)
    t_written = time.monotonic()
    with open(p, "wb") as f:
        for _ in range(5):  # written in pieces, like a download: never hashed half-way
            f.write(os.urandom(100_000))
            f.flush()
            time.sleep(SETTLE / 3)
    rec = wait_for(lambda: lookup(c, "incoming/model.bin"), what="adoption")
    adopted_after = time.monotonic() - t_written
    assert rec["tier"] == "ssd" and rec["size"] == 500_000
    assert adopted_after >= SETTLE
    body = c.get(f"/v1/files/{rec['id']}/content").content
    assert body == p.read_bytes()


def test_modified_in_place_keeps_heat(c, data_dir: Path) -> None:
    fid = c.put("/v1/files/content", params={"path": "m.bin"}, content=b"v1").json()["id"]
    for _ in range(3):
        c.get(f"/v1/files/{fid}/content")
    wait_for(lambda: c.get(f"/v1/files/{fid}").json()["access_count"] == 3)
    (data_dir / "nvme/m.bin").write_bytes(b"version two")
    rec = wait_for(
        lambda: (r := c.get(f"/v1/files/{fid}").json())["size"] == 11 and r, what="modify"
    )
    assert rec["access_count"] == 3 and rec["heat"] > 2.5
    assert c.get(f"/v1/files/{fid}/content").content == b"version two"


def test_deleted_file_goes_missing_and_can_be_purged(srv, c, data_dir: Path) -> None:
    fid = c.put("/v1/files/content", params={"path": "d/x.bin"}, content=b"x").json()["id"]
    c.put("/v1/files/content", params={"path": "d/keep.bin"}, content=b"k")
    (data_dir / "nvme/d/x.bin").unlink()
    wait_for(lambda: c.get(f"/v1/files/{fid}").json()["state"] == "missing", what="missing")
    assert [f["path"] for f in c.get("/v1/files").json()["items"]] == ["d/keep.bin"]
    assert [f["id"] for f in c.get("/v1/files?state=missing").json()["items"]] == [fid]
    assert c.get(f"/v1/files/{fid}/content").status_code == 404
    r = c.delete("/v1/files", params={"state": "missing"})
    assert r.status_code == 200 and r.json()["purged"] == 1
    assert c.get(f"/v1/files/{fid}").status_code == 404
    assert lookup(c, "d/keep.bin") is not None
    bad = c.delete("/v1/files", params={"state": "stable"})
    assert bad.status_code == 422 and lookup(c, "d/keep.bin") is not None


def test_whole_directory_moved_out_goes_missing(c, data_dir: Path, tmp_path: Path) -> None:
    ids = [
        c.put("/v1/files/content", params={"path": f"ckpt/{i}.pt"}, content=b"w").json()["id"]
        for i in range(3)
    ]
    shutil.move(str(data_dir / "nvme/ckpt"), str(tmp_path / "elsewhere"))
    wait_for(
        lambda: all(c.get(f"/v1/files/{i}").json()["state"] == "missing" for i in ids),
        what="directory moved out",
    )


def test_rename_within_a_tier_keeps_identity(c, data_dir: Path) -> None:
    rec = c.put(
        "/v1/files/content", params={"path": "a/old.bin", "tier": "ssd"}, content=b"same bytes"
    ).json()
    c.get(f"/v1/files/{rec['id']}/content")
    assert c.post(f"/v1/files/{rec['id']}/pin", json={"tier": "ssd"}).status_code == 200
    wait_for(lambda: c.get(f"/v1/files/{rec['id']}").json()["access_count"] == 1)
    (data_dir / "ssd/b").mkdir()  # a directory just made: its watch may lag the rename
    os.rename(data_dir / "ssd/a/old.bin", data_dir / "ssd/b/new.bin")
    moved = wait_for(
        lambda: (r := c.get(f"/v1/files/{rec['id']}").json())["path"] == "b/new.bin" and r,
        what="rename",
    )
    assert moved["access_count"] == 1 and moved["checksum"] == rec["checksum"]
    assert moved["pinned_tier"] == "ssd"
    assert moved["state"] == "stable" and lookup(c, "a/old.bin") is None
    assert watcher_status(c)["applied"]["renamed"] == 1


def test_directory_renamed_within_a_tier(c, data_dir: Path) -> None:
    ids = {
        c.put("/v1/files/content", params={"path": f"run1/{n}.bin"}, content=n.encode()).json()[
            "id"
        ]: n
        for n in ("a", "b")
    }
    os.rename(data_dir / "nvme/run1", data_dir / "nvme/run2")
    for fid, n in ids.items():
        wait_for(lambda fid=fid, n=n: c.get(f"/v1/files/{fid}").json()["path"] == f"run2/{n}.bin")


def test_moved_between_tiers_by_hand(c, data_dir: Path) -> None:
    rec = c.put(
        "/v1/files/content", params={"path": "mv.bin", "tier": "nvme"}, content=b"moving"
    ).json()
    shutil.move(str(data_dir / "nvme/mv.bin"), str(data_dir / "hdd/mv.bin"))
    moved = wait_for(
        lambda: (r := c.get(f"/v1/files/{rec['id']}").json())["tier"] == "hdd" and r,
        what="tier move",
    )
    assert moved["state"] == "stable" and moved["path"] == "mv.bin"
    assert c.get(f"/v1/files/{rec['id']}/content").content == b"moving"


def test_conflict_is_reported_and_both_kept(c, data_dir: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="tiering.sync.scan")
    c.put("/v1/files/content", params={"path": "dup.bin", "tier": "ssd"}, content=b"one")
    shutil.copy(data_dir / "ssd/dup.bin", data_dir / "hdd/dup.bin")
    conflicts = wait_for(
        lambda: c.get("/v1/files", params={"state": "conflict"}).json()["items"], what="conflict"
    )
    assert conflicts[0]["path"] == "dup.bin" and "hdd" in conflicts[0]["detail"]
    assert (data_dir / "ssd/dup.bin").exists() and (data_dir / "hdd/dup.bin").exists()
    assert any("conflict" in r.getMessage() for r in caplog.records)


def test_own_writes_are_not_outside_changes(c, data_dir: Path) -> None:
    for i in range(5):
        c.put("/v1/files/content", params={"path": f"own/{i}.bin"}, content=os.urandom(1000))
    c.put("/v1/files/content", params={"path": "own/0.bin", "overwrite": "true"}, content=b"new")
    fid = lookup(c, "own/1.bin")["id"]
    c.delete(f"/v1/files/{fid}")
    for _ in range(5):
        c.get(f"/v1/files/{lookup(c, 'own/2.bin')['id']}/content")
    # tierd's own migrations, back and forth between tiers on the same filesystem.
    mover = lookup(c, "own/3.bin")["id"]
    for tier in ("hdd", "ssd", "nvme"):
        r = c.post("/v1/migrations?wait=true", json={"file_id": mover, "to_tier": tier})
        assert r.status_code == 200, r.text
        assert c.get(f"/v1/files/{mover}").json()["tier"] == tier
    events_before = watcher_status(c)["events"]
    assert events_before > 0
    # Wait until everything the watcher heard has been looked at, then: nothing was "applied".
    wait_for(lambda: watcher_status(c)["pending"] == 0, what="watcher idle")
    status = watcher_status(c)
    assert status["applied"] == dict.fromkeys(status["applied"], 0)
    assert lookup(c, "own/1.bin") is None
    assert c.get("/v1/files", params={"state": "conflict"}).json()["items"] == []
    assert lookup(c, "own/3.bin")["state"] == "stable"


def test_overflow_triggers_full_reconcile(c, data_dir: Path) -> None:
    fid = c.put("/v1/files/content", params={"path": "ghost.bin"}, content=b"g").json()["id"]
    wait_for(lambda: watcher_status(c)["pending"] == 0, what="watcher idle")
    # Drift that no event will ever report: the catalog names a file that is not on disk.
    with sqlite3.connect(data_dir / "catalog.db") as db:
        db.execute(
            "INSERT INTO files (relpath, tier, size, mtime_ns, checksum, state, generation, "
            "access_count, heat, heat_at, created_at, updated_at) VALUES "
            "('phantom.bin', 'ssd', 1, 1, NULL, 'stable', 0, 0, 0, 0, 0, 0)"
        )
    # The same warning watchdog logs when the kernel reports IN_Q_OVERFLOW.
    logging.getLogger("watchdog.observers.inotify_c").warning(
        "Inotify queue overflowed; filesystem events were lost"
    )
    wait_for(lambda: (lookup(c, "phantom.bin") or {}).get("state") == "missing", what="reconcile")
    rows = c.get("/v1/files", params={"state": "missing"}).json()["items"]
    assert [r["path"] for r in rows] == ["phantom.bin"]
    status = watcher_status(c)
    assert status["overflows"] == 1
    assert status["last_full_reconcile_reason"] == "event queue overflow"
    assert c.get(f"/v1/files/{fid}").json()["state"] == "stable"


def test_polling_backend(data_dir: Path) -> None:
    settings = make_settings(
        data_dir, watch_settle_s=SETTLE, watch_backend="polling", watch_poll_interval_s=0.2
    )
    with LiveServer(settings) as srv, srv.client() as c:
        assert watcher_status(c)["backend"] == "polling"
        (data_dir / "hdd/polled.bin").write_bytes(b"p")
        assert wait_for(lambda: lookup(c, "polled.bin"), what="polling adoption")["tier"] == "hdd"


def test_burst_of_small_files_adopted_exactly_once(request, c, data_dir: Path) -> None:
    n = 10_000 if request.config.getoption("--runslow") else 1_000
    root = data_dir / "ssd/burst"
    for d in range(10):
        (root / str(d)).mkdir(parents=True)
    t0 = time.monotonic()
    for i in range(n):
        (root / str(i % 10) / f"{i}.bin").write_bytes(i.to_bytes(4, "little"))
    written = time.monotonic() - t0

    def adopted() -> int:
        return c.get("/readyz").json()["checks"]["catalog"]["files"]

    wait_for(lambda: adopted() == n, timeout=60 + n / 100, what=f"{n} files adopted")
    took = time.monotonic() - t0
    ids, cursor = [], None
    while True:
        page = c.get(
            "/v1/files",
            params={"prefix": "burst/", "limit": 1000} | ({"cursor": cursor} if cursor else {}),
        ).json()
        ids += [f["id"] for f in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert len(ids) == len(set(ids)) == n
    assert watcher_status(c)["applied"]["adopted"] == n
    print(f"\n{n} files: written in {written:.2f}s, all adopted {took:.2f}s after the first write")
