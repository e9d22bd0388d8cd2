"""A tierd without tokens is safe from web pages (issue 40, RELIABILITY.md row 34): a request
with a foreign ``Host`` (DNS rebinding) reads nothing, a state-changing request a page of
another site sends changes nothing; tierd's own dashboard, curl and its clients pass. Each
case is a real HTTP request with the headers a browser sends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import LiveServer, disk_snapshot, make_settings

REBOUND = {"Host": "attacker.example:8470"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("browsers")
    with LiveServer(make_settings(root / "data", watch=False)) as s:
        with httpx.Client(base_url=s.url) as http:
            r = http.put("/v1/files/content", params={"path": "m/w.bin"}, content=b"weights")
            assert r.status_code == 201
        yield s


def accesses(srv: LiveServer, fid: int) -> int:
    """The file's access count with every access counted so far written (the server runs in
    this process: its tracker is flushed, as its own thread does every second)."""
    srv.server.config.app.state.engine.access.flush()
    with httpx.Client(base_url=srv.url) as http:
        return int(http.get(f"/v1/files/{fid}").json()["access_count"])


def _state(srv: LiveServer) -> tuple[Any, dict[str, bytes]]:
    srv.server.config.app.state.engine.access.flush()  # counts of earlier tests' reads
    with httpx.Client(base_url=srv.url) as http:
        # every field but heat, which decays as time passes (its inputs are all here)
        listed = http.get("/v1/files").json()["items"]
        files = [{k: v for k, v in f.items() if k != "heat"} for f in listed]
        policy = http.get("/v1/policy").json()
    return (files, policy), disk_snapshot(srv.settings.data_dir / "nvme")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/files"),
        ("GET", "/v1/files/1/content"),
        ("GET", "/readyz"),
        ("POST", "/v1/scan"),
    ],
)
def test_a_foreign_host_reads_nothing(srv: LiveServer, method: str, path: str) -> None:
    before = _state(srv)
    with httpx.Client(base_url=srv.url) as http:
        r = http.request(method, path, headers=REBOUND)
    assert r.status_code == 421, r.text
    assert r.json()["error"]["code"] == "unknown_host" and b"weights" not in r.content
    assert _state(srv) == before


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/v1/files/1/pin", {"Origin": "https://evil.example"}),  # a fetch() POST, no body
        ("/v1/stats/reset", {"Origin": "null"}),  # a sandboxed or file:// page
        ("/v1/scan", {"Sec-Fetch-Site": "cross-site"}),
        ("/v1/migrations", {"Origin": "http://127.0.0.1:9", "Sec-Fetch-Site": "same-site"}),
        ("/v1/files/1/pin", {"Origin": "http://localhost:3000"}),  # another local server's page
    ],
)
def test_a_cross_site_post_without_a_body_changes_nothing(
    srv: LiveServer, path: str, headers: dict[str, str]
) -> None:
    before = _state(srv)
    with httpx.Client(base_url=srv.url) as http:
        r = http.post(path, headers=headers)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "cross_site_request"
    assert _state(srv) == before


def test_its_own_pages_curl_and_clients_pass(srv: LiveServer) -> None:
    own = {"Origin": srv.url, "Sec-Fetch-Site": "same-origin"}
    with httpx.Client(base_url=srv.url) as http:
        fid = http.get("/v1/files/lookup", params={"path": "m/w.bin"}).json()["id"]
        assert http.post(f"/v1/files/{fid}/pin", headers=own).status_code == 200
        assert http.delete(f"/v1/files/{fid}/pin").status_code == 200  # no browser headers
        for name in ("localhost", "[::1]", "127.0.0.1"):
            host = {"Host": f"{name}:{srv.settings.port}"}
            assert http.get("/healthz", headers=host).status_code == 200, name
        # The user following a link from another site to a page of tierd's.
        link = {
            "Sec-Fetch-Site": "cross-site",
            "Sec-Fetch-Mode": "navigate",
            "Sec-Fetch-User": "?1",
        }
        assert http.get("/docs", headers=link | {"Sec-Fetch-Dest": "document"}).status_code == 200
        # A page of tierd's own, as the browser says so, and its advertised origin.
        own = {"Origin": srv.settings.own_url()}
        assert http.post(f"/v1/files/{fid}/pin", headers=own).status_code == 200
        host = {"Host": urlsplit(srv.settings.own_url()).netloc}
        assert http.delete(f"/v1/files/{fid}/pin", headers=host).status_code == 200
        # The dashboard through an SSH tunnel or a port mapping (localhost:9000 -> tierd): the
        # page's origin is the one the request is sent to.
        tunnel = {"Host": "localhost:9000", "Origin": "http://localhost:9000"}
        assert http.post(f"/v1/files/{fid}/pin", headers=tunnel).status_code == 200
        same = {"Host": "localhost:9000", "Sec-Fetch-Site": "same-origin"}
        assert http.delete(f"/v1/files/{fid}/pin", headers=same).status_code == 200
        other = {"Host": "localhost:9000", "Origin": "http://localhost:9001"}
        assert http.post(f"/v1/files/{fid}/pin", headers=other).status_code == 403


@pytest.mark.parametrize(
    "headers",
    [
        {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "image"},
        {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "cors", "Sec-Fetch-Dest": "empty"},
        {"Origin": "https://evil.example"},  # a CORS GET of a browser without Sec-Fetch-*
        # a link into an <iframe> is not the user's own navigation
        {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "iframe"},
        # nor is a page sending its own window there (location = ...): no Sec-Fetch-User
        {
            "Sec-Fetch-Site": "cross-site",
            "Sec-Fetch-Mode": "navigate",
            "Sec-Fetch-Dest": "document",
        },
    ],
)
def test_a_pages_read_of_content_reads_nothing_and_counts_no_access(
    srv: LiveServer, headers: dict[str, str]
) -> None:
    with httpx.Client(base_url=srv.url) as http:
        fid = http.get("/v1/files/lookup", params={"path": "m/w.bin"}).json()["id"]
        before = accesses(srv, fid)
        r = http.get(f"/v1/files/{fid}/content", headers=headers)
        assert r.status_code == 403 and b"weights" not in r.content
        assert r.json()["error"]["code"] == "cross_site_request"
        assert accesses(srv, fid) == before  # no heat
        assert http.get(f"/v1/files/{fid}/content").content == b"weights"
        assert accesses(srv, fid) == before + 1  # (a read that is served counts)


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/v1/files/1/pin", "application/x-www-form-urlencoded"),  # <form method=post>, no body
        ("/v1/stats/reset", "text/plain;charset=UTF-8"),  # <form enctype=text/plain>
        ("/v1/scan", "multipart/form-data; boundary=x"),
        ("/v1/migrations", "application/x-www-form-urlencoded"),
    ],
)
def test_a_form_post_without_origin_changes_nothing(
    srv: LiveServer, path: str, content_type: str
) -> None:
    """What a browser too old to send Origin or Sec-Fetch-Site sends for a page's form: its
    content type is enough to refuse it."""
    before = _state(srv)
    with httpx.Client(base_url=srv.url) as http:
        r = http.post(path, headers={"Content-Type": content_type})
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert _state(srv) == before


def test_the_refusals_are_counted(srv: LiveServer) -> None:
    def refused(text: str) -> float:
        for line in text.splitlines():
            if line.startswith("tierd_http_requests_total{") and 'status="421"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    with httpx.Client(base_url=srv.url) as http:
        before = refused(http.get("/metrics").text)
        assert http.get("/v1/files", headers=REBOUND).status_code == 421
        assert refused(http.get("/metrics").text) == before + 1


def test_the_refusals_are_declared(srv: LiveServer) -> None:
    with httpx.Client(base_url=srv.url) as http:
        doc = http.get("/openapi.json").json()
    pin = doc["paths"]["/v1/files/{file_id}/pin"]["post"]["responses"]
    assert {"421", "403", "415"} <= set(pin)
    assert "415" in doc["paths"]["/v1/stats/reset"]["post"]["responses"]
    assert {"421", "403"} <= set(doc["paths"]["/v1/files/{file_id}/content"]["get"]["responses"])


def test_with_tokens_any_host_name_is_taken(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "data", watch=False, admin_token="a" * 32)
    with LiveServer(settings) as s, httpx.Client(base_url=s.url) as http:
        assert http.get("/healthz", headers={"Host": "tierd.internal"}).status_code == 200


def test_with_tokens_and_allowed_hosts_the_host_is_checked(tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path / "data", watch=False, admin_token="a" * 32, allowed_hosts=["tierd.internal"]
    )
    with LiveServer(settings) as s, httpx.Client(base_url=s.url) as http:
        assert http.get("/healthz", headers={"Host": "tierd.internal:80"}).status_code == 200
        r = http.get("/healthz", headers={"Host": "attacker.example"})
        assert r.status_code == 421 and r.json()["error"]["code"] == "unknown_host"
