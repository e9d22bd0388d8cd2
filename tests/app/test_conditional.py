"""HTTP semantics of content (issue 40): HEAD and 416 count no access; conditional reads
(If-None-Match, If-Modified-Since, If-Match) and uploads (If-Match, If-None-Match: *); a
checksum sent with an upload is checked before anything is written."""

from __future__ import annotations

import os
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


def _accesses(http: httpx.Client, fid: int) -> int:
    return int(http.get(f"/v1/files/{fid}").json()["access_count"])


def test_head_and_416_count_no_access(http: httpx.Client) -> None:
    fid = _put(http, "acc/a.bin", DATA).json()["id"]
    http.get(f"/v1/files/{fid}/content")
    wait_for(lambda: _accesses(http, fid) == 1, what="the GET counted")
    assert http.head(f"/v1/files/{fid}/content").status_code == 200
    r = http.get(f"/v1/files/{fid}/content", headers={"Range": f"bytes={len(DATA) + 5}-"})
    assert r.status_code == 416
    http.get(f"/v1/files/{fid}/content", headers={"Range": "bytes=0-9"})
    wait_for(lambda: _accesses(http, fid) == 2, what="the range counted")
    assert _accesses(http, fid) == 2  # the HEAD and the 416 read nothing


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
    r = http.get(url, headers={"If-Match": '"0000"'})
    assert r.status_code == 412 and r.json()["error"]["code"] == "precondition_failed"


def test_conditional_uploads_write_nothing_when_refused(
    srv: LiveServer, http: httpx.Client
) -> None:
    r = _put(http, "cond/u.bin", DATA)
    fid, tag = r.json()["id"], http.get(f"/v1/files/{r.json()['id']}/content").headers["etag"]
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
    # The version it names: replaced (If-Match implies the overwrite).
    r = _put(http, "cond/u.bin", b"new", headers={"If-Match": tag})
    assert r.status_code == 200 and http.get(f"/v1/files/{fid}/content").content == b"new"
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
