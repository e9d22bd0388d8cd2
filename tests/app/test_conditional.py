"""HTTP semantics of content (issue 40): HEAD and 416 count no access; conditional reads
(If-None-Match, If-Modified-Since, If-Match) and uploads (If-Match, If-None-Match: *); a
checksum sent with an upload is checked before anything is written."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest

from tests.conftest import LiveServer, disk_snapshot, make_settings, wait_for
from tests.helpers import checksum

DATA = os.urandom(100_000)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("conditional")
    with LiveServer(make_settings(root / "data", watch=False)) as s:
        yield s


@pytest.fixture(scope="module")
def http(srv: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def _put(http: httpx.Client, path: str, data: bytes, **kw: object) -> httpx.Response:
    headers: dict[str, str] | None = kw.pop("headers", None)  # type: ignore[assignment]
    params = {"path": path, **kw}
    return http.put("/v1/files/content", params=params, content=data, headers=headers)


def _accesses(srv: LiveServer, http: httpx.Client, fid: int) -> int:
    """The access count with every access counted so far written (the server runs in this
    process: its tracker is flushed, as its own thread does every second)."""
    srv.server.config.app.state.engine.access.flush()
    return int(http.get(f"/v1/files/{fid}").json()["access_count"])


def test_head_and_416_count_no_access(srv: LiveServer, http: httpx.Client) -> None:
    fid = _put(http, "acc/a.bin", DATA).json()["id"]
    url = f"/v1/files/{fid}/content"
    http.get(url)
    assert _accesses(srv, http, fid) == 1
    assert http.head(url).status_code == 200
    assert http.head(url, headers={"Range": "bytes=0-9"}).status_code == 206
    assert http.get(url, headers={"Range": f"bytes={len(DATA) + 5}-"}).status_code == 416
    assert _accesses(srv, http, fid) == 1  # the HEADs and the 416 read nothing
    http.get(url, headers={"Range": "bytes=0-9"})
    assert _accesses(srv, http, fid) == 2


def test_a_head_reads_no_byte(
    srv: LiveServer, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every read of the disk fails (EIO), and a HEAD still answers: it read nothing (it used
    to stream the whole file for the server to drop)."""
    fid = _put(http, "acc/h.bin", DATA).json()["id"]
    tag = http.get(f"/v1/files/{fid}").json()["checksum"].split(":")[1]

    def eio(*args: object) -> int:
        raise OSError(errno.EIO, "injected: no reads")

    monkeypatch.setattr(os, "preadv", eio)
    r = http.head(f"/v1/files/{fid}/content")
    assert r.status_code == 200 and r.content == b""
    assert r.headers["content-length"] == str(len(DATA)) and r.headers["etag"] == f'"{tag}"'
    monkeypatch.undo()
    assert http.get(f"/v1/files/{fid}/content").content == DATA


def test_conditional_reads(http: httpx.Client) -> None:
    fid = _put(http, "cond/r.bin", DATA).json()["id"]
    r = http.get(f"/v1/files/{fid}/content")
    tag, modified = r.headers["etag"], r.headers["last-modified"]
    assert tag == f'"{checksum(DATA).split(":")[1]}"' and modified.endswith("GMT")
    url = f"/v1/files/{fid}/content"
    r = http.get(url, headers={"If-None-Match": tag})
    assert r.status_code == 304 and r.content == b"" and r.headers["etag"] == tag
    assert http.get(url, headers={"If-None-Match": '"0000"'}).status_code == 200
    assert http.get(url, headers={"If-Modified-Since": modified}).status_code == 304
    earlier = format_datetime(datetime.now(UTC) - timedelta(days=400), usegmt=True)
    assert http.get(url, headers={"If-Modified-Since": earlier}).status_code == 200
    assert http.get(url, headers={"If-Match": tag}).content == DATA
    assert http.get(url, headers={"If-Match": "*"}).content == DATA
    r = http.get(url, headers={"If-Match": '"0000"'})
    assert r.status_code == 412 and r.json()["error"]["code"] == "precondition_failed"
    # If-Match compares strongly (a weak tag matches nothing), If-None-Match weakly.
    assert http.get(url, headers={"If-Match": f"W/{tag}"}).status_code == 412
    assert http.get(url, headers={"If-None-Match": f'"x", W/{tag}'}).status_code == 304
    assert http.get(url, headers={"If-None-Match": "*"}).status_code == 304


def test_conditional_uploads_write_nothing_when_refused(
    srv: LiveServer, http: httpx.Client
) -> None:
    r = _put(http, "cond/u.bin", DATA)
    fid, tag = r.json()["id"], r.headers["etag"]  # the upload names the version it wrote
    assert tag == http.get(f"/v1/files/{fid}/content").headers["etag"]
    assert r.headers["last-modified"].endswith("GMT")
    before = disk_snapshot(srv.settings.data_dir / "nvme")
    # If-Match names another version: 412, nothing written.
    r = _put(http, "cond/u.bin", b"new", headers={"If-Match": '"' + "0" * 32 + '"'})
    assert r.status_code == 412 and r.json()["error"]["code"] == "precondition_failed"
    # If-None-Match: * on a file that exists: 412.
    assert _put(http, "cond/u.bin", b"new", headers={"If-None-Match": "*"}).status_code == 412
    # If-Match on a file that does not exist: 412, and it is not created.
    assert _put(http, "cond/none.bin", b"new", headers={"If-Match": "*"}).status_code == 412
    assert disk_snapshot(srv.settings.data_dir / "nvme") == before
    assert http.get(f"/v1/files/{fid}/content").content == DATA
    # A weak tag never matches an upload's If-Match (strong comparison).
    assert _put(http, "cond/u.bin", b"new", headers={"If-Match": f"W/{tag}"}).status_code == 412
    # The version it names: replaced (If-Match implies the overwrite).
    r = _put(http, "cond/u.bin", b"new", headers={"If-Match": tag})
    assert r.status_code == 200 and http.get(f"/v1/files/{fid}/content").content == b"new"
    assert r.headers["etag"] == f'"{checksum(b"new").split(":")[1]}"'
    assert _put(http, "cond/fresh.bin", b"x", headers={"If-None-Match": "*"}).status_code == 201


def test_a_checksum_sent_with_an_upload_is_checked(srv: LiveServer, http: httpx.Client) -> None:
    good = checksum(DATA)
    r = _put(http, "sum/ok.bin", DATA, checksum=good)
    assert r.status_code == 201 and r.json()["checksum"] == good
    before = disk_snapshot(srv.settings.data_dir)
    bad = "xxh3_128:" + "0" * 32
    r = _put(http, "sum/bad.bin", DATA, checksum=bad)
    assert r.status_code == 400 and r.json()["error"]["code"] == "checksum_mismatch"
    assert http.get("/v1/files/lookup", params={"path": "sum/bad.bin"}).status_code == 404
    after = disk_snapshot(srv.settings.data_dir)
    assert {k for k in after if "nvme" in k} == {k for k in before if "nvme" in k}
    # An overwrite with a wrong checksum leaves the old bytes.
    r = _put(http, "sum/ok.bin", b"other", checksum=bad, overwrite="true")
    assert r.status_code == 400
    fid = http.get("/v1/files/lookup", params={"path": "sum/ok.bin"}).json()["id"]
    assert http.get(f"/v1/files/{fid}/content").content == DATA
    r = _put(http, "sum/x.bin", DATA, checksum="md5:abc")
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"


def _held_upload(
    srv: LiveServer, path: str, headers: dict[str, str], release: threading.Event
) -> tuple[threading.Thread, list[httpx.Response]]:
    """An upload whose last bytes wait for ``release``, in a thread; returns once the server
    has begun it (its temp file is in the tier)."""
    out: list[httpx.Response] = []
    folder = srv.settings.data_dir / "nvme" / path.rsplit("/", 1)[0]
    entries = set(os.listdir(folder)) if folder.is_dir() else set()

    def body() -> Iterator[bytes]:
        yield b"held "
        release.wait(30)
        yield b"upload"

    def send() -> None:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            params = {"path": path}
            out.append(c.put("/v1/files/content", params=params, content=body(), headers=headers))

    thread = threading.Thread(target=send)
    thread.start()
    wait_for(lambda: folder.is_dir() and set(os.listdir(folder)) - entries, what="its temp")
    return thread, out


@pytest.mark.parametrize("condition", ["If-Match", "If-None-Match"])
def test_a_condition_holds_until_the_bytes_are_published(
    srv: LiveServer, http: httpx.Client, condition: str
) -> None:
    """Two uploads on the same condition (replace version 1; create the file): the one that
    publishes second is a 412, and publishes nothing (no lost update)."""
    path = f"race/{condition.lower()}.bin"
    headers = {"If-None-Match": "*"}
    if condition == "If-Match":
        headers = {"If-Match": _put(http, path, b"version 1").headers["etag"]}
    release = threading.Event()
    thread, out = _held_upload(srv, path, headers, release)
    try:
        r = _put(http, path, b"the other upload", headers=headers)
        assert r.status_code in (200, 201), r.text
    finally:
        release.set()
        thread.join(30)
    assert out[0].status_code == 412, out[0].text
    assert out[0].json()["error"]["code"] == "precondition_failed"
    fid = http.get("/v1/files/lookup", params={"path": path}).json()["id"]
    assert http.get(f"/v1/files/{fid}/content").content == b"the other upload"
    # No temp is left: the folder holds the files the catalog has, and nothing else.
    listed = http.get("/v1/files", params={"prefix": "race/"}).json()["items"]
    assert set(os.listdir(srv.settings.data_dir / "nvme" / "race")) == {
        f["path"].removeprefix("race/") for f in listed
    }
