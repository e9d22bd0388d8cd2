"""The file API through the real app: upload, list, lookup, ranges, delete, and bad input."""

from __future__ import annotations

import errno
import os
import sqlite3
import time
from pathlib import Path

import pytest

from tests.conftest import LiveServer, disk_snapshot, make_settings
from tiering.checksum import Hasher


def checksum(data: bytes) -> str:
    h = Hasher()
    h.update(data)
    return h.value()


def upload(c, path: str, data: bytes, **params):
    return c.put("/v1/files/content", params={"path": path, **params}, content=data)


def catalog_rows(data_dir: Path) -> list[tuple]:
    with sqlite3.connect(data_dir / "catalog.db") as db:
        return db.execute(
            "SELECT id, relpath, tier, size, checksum, state, generation FROM files ORDER BY id"
        ).fetchall()


# -- happy paths ---------------------------------------------------------------------------
def test_upload_lookup_read_delete(client, data_dir: Path) -> None:
    data = os.urandom(300_000)
    r = upload(client, "models/llama/shard-1.bin", data, tier="ssd")
    assert r.status_code == 201, r.text
    rec = r.json()
    assert rec["path"] == "models/llama/shard-1.bin"
    assert rec["tier"] == "ssd" and rec["size"] == len(data)
    assert rec["checksum"] == checksum(data)
    assert (data_dir / "ssd/models/llama/shard-1.bin").read_bytes() == data
    assert not list(data_dir.rglob("*.tierd-tmp"))

    assert client.get(f"/v1/files/{rec['id']}").json()["checksum"] == rec["checksum"]
    found = client.get("/v1/files/lookup", params={"path": "models/llama/shard-1.bin"})
    assert found.status_code == 200 and found.json()["id"] == rec["id"]

    full = client.get(f"/v1/files/{rec['id']}/content")
    assert full.status_code == 200 and full.content == data
    assert full.headers["etag"] == f'"{rec["checksum"].split(":")[1]}"'
    assert full.headers["accept-ranges"] == "bytes"

    gone = client.delete(f"/v1/files/{rec['id']}")
    assert gone.status_code == 200 and gone.json()["deleted"]["id"] == rec["id"]
    assert not (data_dir / "ssd/models/llama/shard-1.bin").exists()
    assert client.get(f"/v1/files/{rec['id']}").status_code == 404
    assert catalog_rows(data_dir) == []


def test_upload_defaults_to_fastest_tier_and_empty_file(client, data_dir: Path) -> None:
    r = upload(client, "empty", b"")
    assert r.status_code == 201 and r.json()["tier"] == "nvme" and r.json()["size"] == 0
    body = client.get(f"/v1/files/{r.json()['id']}/content")
    assert body.status_code == 200 and body.content == b""


@pytest.mark.parametrize(
    ("header", "expect", "content_range"),
    [
        ("bytes=0-0", slice(0, 1), "bytes 0-0/1000"),
        ("bytes=10-19", slice(10, 20), "bytes 10-19/1000"),
        ("bytes=990-", slice(990, 1000), "bytes 990-999/1000"),
        ("bytes=-5", slice(995, 1000), "bytes 995-999/1000"),
        ("bytes=900-5000", slice(900, 1000), "bytes 900-999/1000"),
        ("bytes=-5000", slice(0, 1000), "bytes 0-999/1000"),
    ],
)
def test_range_reads(client, header: str, expect: slice, content_range: str) -> None:
    data = os.urandom(1000)
    fid = upload(client, "r.bin", data).json()["id"]
    r = client.get(f"/v1/files/{fid}/content", headers={"Range": header})
    assert r.status_code == 206
    assert r.content == data[expect]
    assert r.headers["content-range"] == content_range
    assert int(r.headers["content-length"]) == len(data[expect])


@pytest.mark.parametrize(
    "header",
    [
        "bytes=1000-",
        "bytes=5000-6000",
        "bytes=-0",
        "bytes=5-2",
        "bytes=0-1,3-4",
        "items=0-1",
        "bytes=abc",
        "bytes=-",
    ],
)
def test_bad_ranges_are_416(client, header: str) -> None:
    fid = upload(client, "r.bin", os.urandom(1000)).json()["id"]
    r = client.get(f"/v1/files/{fid}/content", headers={"Range": header})
    assert r.status_code == 416
    assert r.json()["error"]["code"] == "invalid_range"
    assert r.headers["content-range"] == "bytes */1000"


def test_if_range_mismatch_sends_whole_file(client) -> None:
    data = os.urandom(100)
    fid = upload(client, "r.bin", data).json()["id"]
    r = client.get(
        f"/v1/files/{fid}/content", headers={"Range": "bytes=0-9", "If-Range": '"stale"'}
    )
    assert r.status_code == 200 and r.content == data


def test_overwrite_replaces_atomically_and_keeps_identity(client, data_dir: Path) -> None:
    first = upload(client, "w.bin", b"one").json()
    client.get(f"/v1/files/{first['id']}/content")
    r = upload(client, "w.bin", b"second version", overwrite="true")
    assert r.status_code == 200, r.text
    rec = r.json()
    assert rec["id"] == first["id"] and rec["generation"] == first["generation"] + 1
    assert rec["checksum"] == checksum(b"second version")
    assert (data_dir / "nvme/w.bin").read_bytes() == b"second version"


def test_overwrite_into_another_tier_moves_the_file(client, data_dir: Path) -> None:
    first = upload(client, "w.bin", b"one", tier="hdd").json()
    r = upload(client, "w.bin", b"two", tier="nvme", overwrite="true")
    assert r.status_code == 200 and r.json()["tier"] == "nvme" and r.json()["id"] == first["id"]
    assert not (data_dir / "hdd/w.bin").exists()
    assert (data_dir / "nvme/w.bin").read_bytes() == b"two"


def test_list_filters_and_cursor_pagination(client) -> None:
    for i in range(7):
        upload(client, f"a/{i}.bin", b"x" * i, tier="ssd" if i % 2 else "hdd")
    upload(client, "b/other.bin", b"y")
    upload(client, "a_b/underscore.bin", b"z")  # '_' must not act as a LIKE wildcard

    seen, cursor = [], None
    while True:
        params = {"prefix": "a/", "limit": 3} | ({"cursor": cursor} if cursor else {})
        page = client.get("/v1/files", params=params).json()
        seen += [f["path"] for f in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [f"a/{i}.bin" for i in range(7)]

    ssd = client.get("/v1/files", params={"tier": "ssd"}).json()["items"]
    assert sorted(f["path"] for f in ssd) == ["a/1.bin", "a/3.bin", "a/5.bin"]
    assert [
        f["path"] for f in client.get("/v1/files", params={"prefix": "a_"}).json()["items"]
    ] == ["a_b/underscore.bin"]


def test_tiers_endpoint(client) -> None:
    upload(client, "t.bin", b"12345", tier="ssd")
    tiers = client.get("/v1/tiers").json()
    assert [t["name"] for t in tiers] == ["nvme", "ssd", "hdd"]
    assert [t["rank"] for t in tiers] == [0, 1, 2]
    ssd = tiers[1]
    assert ssd["files"] == 1 and ssd["file_bytes"] == 5
    # No nvidia-fs here (nor on the GPU machine): no tier takes the direct path.
    assert [t["gds"] for t in tiers] == [False, False, False]
    assert ssd["capacity_bytes"] >= ssd["free_bytes"] > 0


def test_health_and_ready(client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert set(ready.json()["checks"]["tiers"]) == {"nvme", "ssd", "hdd"}


def test_readyz_reports_a_broken_tier(client, data_dir: Path) -> None:
    (data_dir / "hdd").rmdir()
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["checks"]["tiers"]["hdd"]["ok"] is False


def test_openapi_served(client) -> None:
    assert "/v1/files/{file_id}/content" in client.get("/openapi.json").json()["paths"]


# -- bad input: a clear 4xx, JSON error, and nothing changed on disk or in the catalog --------
@pytest.mark.parametrize(
    ("params", "status", "code"),
    [
        ({"path": "../escape.bin"}, 422, "invalid_path"),
        ({"path": "/etc/passwd"}, 422, "invalid_path"),
        ({"path": "a/../../x"}, 422, "invalid_path"),
        ({"path": "a//b"}, 422, "invalid_path"),
        ({"path": "a/./b"}, 422, "invalid_path"),
        ({"path": "nul\x00byte"}, 422, "invalid_path"),
        ({"path": "x" * 256}, 422, "invalid_path"),
        ({"path": "/".join(["d"] * 600)}, 422, "invalid_path"),
        ({"path": "a/.w-1.tierd-tmp"}, 422, "invalid_path"),
        ({"path": ".tierd-compressed/m.bin"}, 422, "invalid_path"),  # an object tier's
        ({"path": ".tierd-copies/1.0"}, 422, "invalid_path"),
        ({"path": ""}, 422, "invalid_path"),
        ({"path": "ok.bin", "tier": "floppy"}, 404, "tier_not_found"),
        ({"path": "existing.bin"}, 409, "already_exists"),
        ({"path": "ok.bin", "overwrite": "maybe"}, 422, "invalid_request"),
        ({}, 422, "invalid_request"),
    ],
)
def test_bad_uploads_change_nothing(client, data_dir: Path, params, status, code) -> None:
    upload(client, "existing.bin", b"keep me")
    before_disk, before_db = disk_snapshot(data_dir), catalog_rows(data_dir)
    r = client.put("/v1/files/content", params=params, content=b"payload")
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert r.json()["error"]["message"]
    assert disk_snapshot(data_dir) == before_disk
    assert catalog_rows(data_dir) == before_db


def test_upload_over_max_bytes_is_413_and_leaves_nothing(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "d", max_upload_bytes=1000)
    with LiveServer(settings) as srv, srv.client() as c:
        r = c.put("/v1/files/content", params={"path": "big"}, content=b"x" * 1001)
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"

        def chunks():  # no Content-Length: the limit is enforced while streaming
            for _ in range(20):
                yield b"y" * 100

        r = c.put("/v1/files/content", params={"path": "big2"}, content=chunks())
        assert r.status_code == 413, r.text
        assert c.get("/v1/files").json()["items"] == []
    assert disk_snapshot(tmp_path / "d") == {}


def test_quota_gives_507(tmp_path: Path) -> None:
    root = tmp_path / "d"
    tiers = [
        {"name": "fast", "path": str(root / "fast"), "quota_bytes": 100},
        {"name": "slow", "path": str(root / "slow")},
    ]
    settings = make_settings(root, tiers=tiers)
    with LiveServer(settings) as srv, srv.client() as c:
        assert (
            c.put("/v1/files/content", params={"path": "a"}, content=b"x" * 60).status_code == 201
        )
        r = c.put("/v1/files/content", params={"path": "b"}, content=b"x" * 60)
        assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_space"
        # Overwriting within the quota is fine: the old bytes no longer count.
        r = c.put("/v1/files/content", params={"path": "a", "overwrite": "true"}, content=b"z" * 90)
        assert r.status_code == 200
    assert disk_snapshot(root) == {"fast/a": b"z" * 90}


def test_enospc_mid_upload_is_507_and_cleans_up(client, data_dir: Path, monkeypatch) -> None:
    real_write = os.write
    calls = {"n": 0}

    def failing_write(fd, data):
        calls["n"] += 1
        if calls["n"] >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, bytes(data[:65536]))  # short writes, as a full disk gives

    before = disk_snapshot(data_dir)
    monkeypatch.setattr(os, "write", failing_write)
    r = client.put("/v1/files/content", params={"path": "full.bin"}, content=os.urandom(3 << 20))
    monkeypatch.undo()
    assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_space"
    assert disk_snapshot(data_dir) == before
    assert catalog_rows(data_dir) == []


def test_fsync_failure_discards_the_upload(client, data_dir: Path, monkeypatch) -> None:
    def failing_fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    r = client.put("/v1/files/content", params={"path": "eio.bin"}, content=b"data")
    monkeypatch.undo()
    assert r.status_code == 500 and r.json()["error"]["code"] == "io_error"
    assert disk_snapshot(data_dir) == {}
    assert catalog_rows(data_dir) == []


@pytest.mark.parametrize(
    ("method", "url", "status"),
    [
        ("get", "/v1/files/999", 404),
        ("get", "/v1/files/999/content", 404),
        ("delete", "/v1/files/999", 404),
        ("get", "/v1/files/abc", 404),  # ids are digits: no route takes "abc"
        ("delete", "/v1/files/lookup", 405),  # not a file id either
        ("get", "/v1/files/lookup?path=nope", 404),
        ("get", "/v1/files/lookup?path=../x", 422),
        ("get", "/v1/files?tier=nope", 404),
        ("get", "/v1/files?limit=0", 422),
        ("get", "/v1/files?limit=100000", 422),
        ("get", "/v1/files?cursor=!!!", 422),
        ("get", "/v1/files?cursor=aWQ6eA", 422),
        ("get", "/v1/files?state=weird", 422),
        ("get", "/v1/nothing-here", 404),
    ],
)
def test_bad_requests(client, data_dir: Path, method: str, url: str, status: int) -> None:
    upload(client, "keep.bin", b"k")
    before = disk_snapshot(data_dir), catalog_rows(data_dir)
    r = getattr(client, method)(url)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) >= {"code", "message"}
    assert (disk_snapshot(data_dir), catalog_rows(data_dir)) == before


# -- symlinks: never a byte from outside a tier root ------------------------------------------
def test_symlink_escape_is_never_served(client, data_dir: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"TOP SECRET")
    rec = upload(client, "dir/file.bin", b"public").json()
    # Swap the file for a symlink pointing outside the tier, behind tierd's back.
    target = data_dir / "nvme/dir/file.bin"
    target.unlink()
    target.symlink_to(secret)
    r = client.get(f"/v1/files/{rec['id']}/content")
    assert r.status_code in (404, 422)
    assert b"SECRET" not in r.content
    # A symlinked directory component is refused too.
    target.unlink()
    (data_dir / "nvme/dir").rmdir()
    (data_dir / "nvme/dir").symlink_to(tmp_path)
    r = client.get(f"/v1/files/{rec['id']}/content")
    assert r.status_code in (404, 422) and b"SECRET" not in r.content


def test_upload_through_symlinked_dir_is_refused(client, data_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (data_dir / "nvme/link").symlink_to(outside)
    r = upload(client, "link/evil.bin", b"x")
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_path"
    assert list(outside.iterdir()) == []


# -- the real server: persistence across a restart -----------------------------------------
def test_restart_keeps_files_and_accesses(settings) -> None:
    data = os.urandom(50_000)
    with LiveServer(settings) as srv, srv.client() as c:
        fid = upload(c, "keep/me.bin", data, tier="hdd").json()["id"]
        for _ in range(3):
            assert c.get(f"/v1/files/{fid}/content").content == data
    with LiveServer(settings) as srv, srv.client() as c:
        rec = c.get(f"/v1/files/{fid}").json()
        assert rec["tier"] == "hdd" and rec["access_count"] == 3 and rec["heat"] > 2.9
        r = c.get(f"/v1/files/{fid}/content", headers={"Range": "bytes=100-199"})
        assert r.status_code == 206 and r.content == data[100:200]
        assert c.get("/v1/files").json()["items"][0]["path"] == "keep/me.bin"


# -- overload: a locked catalog gives 503, a flood gives 429, and nothing half-done remains ------
def test_locked_catalog_gives_503_and_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "d"
    settings = make_settings(root, busy_timeout_ms=200)
    with LiveServer(settings) as srv, srv.client() as c:
        keep = upload(c, "keep.bin", b"k").json()
        before_disk, before_db = disk_snapshot(root), catalog_rows(root)
        blocker = sqlite3.connect(root / "catalog.db", isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            r = upload(c, "new.bin", b"fresh bytes")
            assert r.status_code == 503 and r.json()["error"]["code"] == "catalog_busy"
            r = c.delete(f"/v1/files/{keep['id']}")
            assert r.status_code == 503
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert disk_snapshot(root) == before_disk and catalog_rows(root) == before_db
        assert upload(c, "new.bin", b"fresh bytes").status_code == 201


def test_flood_gets_429_and_server_stays_up(tmp_path: Path) -> None:
    import threading

    settings = make_settings(tmp_path / "d", max_inflight_requests=2)
    with LiveServer(settings) as srv, srv.client() as c:
        release = threading.Event()

        def slow_body():
            yield b"x"
            release.wait(10)
            yield b"y"

        holders = [
            threading.Thread(target=lambda i=i: upload(srv.client(), f"slow{i}", slow_body()))
            for i in range(2)
        ]
        for t in holders:
            t.start()
        try:
            # Both uploads are admitted once their temp files exist; only then probe, so the
            # probe cannot take a slot a holder needs.
            temps = lambda: list((tmp_path / "d/nvme").glob("*.tierd-tmp"))  # noqa: E731
            deadline = time.monotonic() + 10
            while len(temps()) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            r = c.get("/v1/tiers")
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests"
            assert r.headers["retry-after"] == "1"
            # Like every error body, the 429's names the request (the id of X-Request-ID).
            assert r.json()["error"]["request_id"] == r.headers["x-request-id"]
            r = c.get("/v1/tiers", headers={"X-Request-ID": "flood-probe-1"})
            assert r.status_code == 429 and r.json()["error"]["request_id"] == "flood-probe-1"
            assert r.headers["x-request-id"] == "flood-probe-1"
            assert c.get("/healthz").status_code == 200
        finally:
            release.set()
            for t in holders:
                t.join()
        assert c.get("/v1/tiers").status_code == 200
        assert sorted(f["path"] for f in c.get("/v1/files").json()["items"]) == ["slow0", "slow1"]
