"""What a newcomer met in the first hour (issue 27), each through the real server where HTTP
behaviour is the point: a client gone mid-upload, HEAD, bodies not sent as JSON, paths that are
not UTF-8, a file beneath a file, the server's paths in errors, /docs offline."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveServer, make_settings, wait_for
from tiering.engine import Engine
from tiering.errors import FileBusy

MIB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One tierd for the module: each test works under paths of its own."""
    root = tmp_path_factory.mktemp("first-hour") / "data"
    with LiveServer(make_settings(root, watch=False)) as srv:
        yield srv


@pytest.fixture
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def _root(server: LiveServer) -> Path:
    return Path(server.settings.data_dir)


def _cut_upload(server: LiveServer, query: str, sent: int, declared: int) -> None:
    """PUT with a ``declared`` Content-Length, send ``sent`` bytes of it, and hang up."""
    with socket.create_connection(("127.0.0.1", server.settings.port)) as s:
        head = (
            f"PUT /v1/files/content?{query} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {declared}\r\n\r\n"
        )
        s.sendall(head.encode() + b"x" * sent)


def _count(http: httpx.Client, method: str, status: int) -> float:
    labels = f'method="{method}",route="/v1/files/content",status="{status}"'
    line = f"tierd_http_requests_total{{{labels}}}"
    for row in http.get("/metrics").text.splitlines():
        if row.startswith(line):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_gone_mid_upload_is_one_line_a_499_and_leaves_nothing(
    server: LiveServer, http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    keep = os.urandom(3000)
    assert http.put("/v1/files/content", params={"path": "cut/keep.bin"}, content=keep).is_success
    before = _count(http, "PUT", 499)
    with caplog.at_level(logging.WARNING):
        _cut_upload(server, "path=abort/deep/a.bin", sent=2 * MIB, declared=5 * MIB)
        wait_for(lambda: _count(http, "PUT", 499) == before + 1, what="the 499 counted")
        # An aborted overwrite: the file it would have replaced is untouched.
        _cut_upload(server, "path=cut/keep.bin&overwrite=true", sent=MIB, declared=5 * MIB)
        wait_for(lambda: _count(http, "PUT", 499) == before + 2, what="the second 499")
    assert _count(http, "PUT", 500) == 0
    nvme = _root(server) / "nvme"
    assert not (nvme / "abort").exists(), "the directories made for the upload stay"
    assert sorted(p.name for p in (nvme / "cut").iterdir()) == ["keep.bin"]
    assert (nvme / "cut/keep.bin").read_bytes() == keep
    assert http.get("/v1/files/lookup", params={"path": "abort/deep/a.bin"}).status_code == 404
    said = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(said) == 2 and all(r.exc_info is None for r in said)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_head_is_answered_wherever_get_is(http: httpx.Client) -> None:
    r = http.head("/readyz")
    assert r.status_code == 200 and r.content == b""
    data = b"0123456789" * 100
    rec = http.put("/v1/files/content", params={"path": "head/f.bin"}, content=data).json()
    r = http.head(f"/v1/files/{rec['id']}/content")
    assert r.status_code == 200 and r.headers["content-length"] == str(len(data))
    assert r.content == b""
    r = http.head("/v1/files/999999")
    assert r.status_code == 404
    # A path without GET still says so, and Allow tells the truth about HEAD.
    r = http.head("/v1/prefetch")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_a_body_not_sent_as_json_is_a_415_that_says_why(http: httpx.Client) -> None:
    rec = http.put("/v1/files/content", params={"path": "json/f.bin"}, content=b"abc").json()
    url = f"/v1/files/{rec['id']}/pin"
    # curl -d's default type, and no type at all: neither is read as JSON.
    for headers in ({"Content-Type": "application/x-www-form-urlencoded"}, {}):
        r = http.post(url, content=b'{"tier": "ssd"}', headers=headers)
        assert r.status_code == 415, r.text
        message = r.json()["error"]["message"]
        assert "Content-Type: application/json" in message
    assert http.get(f"/v1/files/{rec['id']}").json()["pinned_tier"] is None
    # A route that takes any JSON value (a policy document) is refused the same way.
    before = http.get("/v1/policy").json()["version"]
    r = http.put("/v1/policy", content=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and http.get("/v1/policy").json()["version"] == before
    r = http.post(url, json={"tier": "ssd"})
    assert r.status_code == 200, r.text
    doc = http.get("/openapi.json").json()
    with_body = [
        (path, method)
        for path, ops in doc["paths"].items()
        for method, op in ops.items()
        if "application/json" in op.get("requestBody", {}).get("content", {})
    ]
    assert with_body and all("415" in doc["paths"][p][m]["responses"] for p, m in with_body)


def test_a_path_that_is_not_utf8_is_a_422(server: LiveServer, http: httpx.Client) -> None:
    def on_disk() -> list[Path]:
        return sorted(
            p
            for p in _root(server).rglob("*")
            if p.is_file() and not p.name.startswith("catalog.db")
        )

    def records() -> list[tuple[object, ...]]:
        # What a write would change; heat and access counts of other tests' files move on
        # by themselves (accesses reach the catalog in batches, heat decays).
        keys = ("id", "path", "tier", "size", "checksum", "generation", "state")
        return [tuple(f[k] for k in keys) for f in http.get("/v1/files").json()["items"]]

    disk, catalog = on_disk(), records()
    for raw in ("%ff%fe", "%ff%fd", "ok/%c3"):
        r = http.put(f"/v1/files/content?path={raw}", content=b"x")
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_path", raw
        assert "UTF-8" in r.json()["error"]["message"]
    # Refused before anything was written: no file on a tier, no record in the catalog.
    assert on_disk() == disk and records() == catalog
    # Real non-ASCII names are fine.
    r = http.put("/v1/files/content?path=utf8/%C3%A9t%C3%A9.bin", content=b"x")
    assert r.status_code == 201 and r.json()["path"] == "utf8/été.bin"


def test_a_file_beneath_a_file_is_a_409_that_names_it(
    server: LiveServer, http: httpx.Client
) -> None:
    def put(path: str, **params: object) -> httpx.Response:
        return http.put("/v1/files/content", params={"path": path, **params}, content=b"x")

    assert put("clash/h.txt").status_code == 201
    for path, tier in (("clash/h.txt/x", None), ("clash/h.txt/y/z", "ssd")):
        r = put(path, **({"tier": tier} if tier else {}))
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "path_conflict" and err["conflict"] == "clash/h.txt"
    # The other way round: a file over a directory of files, on another tier.
    r = put("clash", tier="hdd")
    assert r.status_code == 409 and r.json()["error"]["conflict"] == "clash/h.txt"
    root = _root(server)
    assert not (root / "ssd/clash").exists() and not (root / "hdd/clash").exists()
    assert (root / "nvme/clash/h.txt").is_file()


def test_errors_name_files_by_relpath_not_the_servers_path(
    server: LiveServer, http: httpx.Client
) -> None:
    http.put("/v1/files/content", params={"path": "bad/w.safetensors"}, content=b"\xff" * 16)
    r = http.post("/v1/load/safetensors", json={"paths": ["bad/w.safetensors"], "device": "cpu"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "malformed_file"
    assert str(_root(server)) not in r.text
    assert err["message"].startswith("bad/w.safetensors: not a valid safetensors file")


def test_unknown_job_is_job_not_found(http: httpx.Client) -> None:
    r = http.get("/v1/jobs/zzz")
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"


def test_docs_come_from_the_package(http: httpx.Client) -> None:
    page = http.get("/docs")
    assert page.status_code == 200
    assert "cdn" not in page.text.lower() and "/docs/assets/swagger-ui-bundle.js" in page.text
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        r = http.get(f"/docs/assets/{asset}")
        assert r.status_code == 200 and len(r.content) > 10_000, asset


def test_a_concurrent_overwrite_says_what_holds_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two overwrites of one file: the second to commit is told the file is being overwritten,
    not migrated (no move runs)."""
    settings = make_settings(tmp_path / "data", watch=False, scan_on_start=False)
    with Engine(settings.engine_config()) as eng:
        up = eng.begin_upload("race/f.bin")
        up.write(b"v0")
        up.commit()
        first, second = (eng.begin_upload("race/f.bin", overwrite=True) for _ in range(2))
        first.write(b"v1")
        second.write(b"v2")
        inside, go = threading.Event(), threading.Event()
        rename = os.rename

        def slow_rename(*args: object, **kwargs: object) -> None:
            inside.set()  # the first commit holds the file's guard here
            go.wait(10)
            rename(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "rename", slow_rename)
        t = threading.Thread(target=first.commit)
        t.start()
        try:
            assert inside.wait(10)
            with pytest.raises(FileBusy) as busy:
                second.commit()
        finally:
            go.set()
            t.join()
            second.abort()
        assert "being overwritten" in busy.value.message
        assert "migrat" not in busy.value.message


def test_a_quarantine_is_cleared_by_a_scan_once_the_bytes_are_settled(
    server: LiveServer, http: httpx.Client
) -> None:
    """What the README tells an operator: settle the bytes, then POST /v1/scan."""
    rec = http.put("/v1/files/content", params={"path": "q/f.bin"}, content=b"kept").json()
    engine: Engine = server.server.config.app.state.engine  # the served catalog, in-process
    # What a move that could not decide leaves (tests/moves make real ones).
    engine.catalog.set_state([rec["id"]], "quarantined", "another file already at the destination")
    r = http.get("/v1/files", params={"state": "quarantined"}).json()["items"]
    assert [f["detail"] for f in r if f["id"] == rec["id"]]
    assert http.post("/v1/scan").is_success
    after = http.get(f"/v1/files/{rec['id']}").json()
    assert after["state"] == "stable" and after["detail"] is None
