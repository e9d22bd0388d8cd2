"""The API contract at the boundary: out-of-range integers are 404/422 with the error body,
never a 500, and the OpenAPI schema declares the bounds and each operation's error statuses."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.api.responses import MAX_ID
from app.main import create_app
from tests.conftest import disk_snapshot
from tests.helpers import engine_settings

ADMIN, DATA = "admin-secret", "data-secret"
HUGE = "1198896185996967501889536"


@pytest.fixture
def api(tmp_path: Path) -> Iterator[TestClient]:
    settings = engine_settings(tmp_path / "data", admin_token=ADMIN, data_token=DATA)
    with TestClient(
        create_app(settings), raise_server_exceptions=False, base_url="http://127.0.0.1"
    ) as c:
        c.headers["Authorization"] = f"Bearer {ADMIN}"
        yield c


def _is_error(r: Any, *statuses: int) -> None:
    assert r.status_code in statuses, (r.status_code, r.text)
    body = r.json()["error"]
    assert isinstance(body["code"], str) and isinstance(body["message"], str)


def _int_path_routes(api: TestClient) -> list[tuple[str, str]]:
    spec = api.get("/openapi.json").json()
    out = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            params = op.get("parameters", [])
            if any(p["in"] == "path" and p["schema"].get("type") == "integer" for p in params):
                out.append((method.upper(), path))
    return out


def test_the_issue_urls_are_422_not_500(api: TestClient, tmp_path: Path) -> None:
    api.put("/v1/files/content", params={"path": "a.bin", "tier": "nvme"}, content=b"x")
    before = disk_snapshot(tmp_path / "data")
    _is_error(api.delete(f"/v1/files/{HUGE}/pin"), 404, 422)
    _is_error(
        api.get("/v1/migrations", params={"file_id": "52267692380743628187743025102848"}), 422
    )
    assert disk_snapshot(tmp_path / "data") == before


def test_oversized_id_on_every_integer_path_route(api: TestClient, tmp_path: Path) -> None:
    api.put("/v1/files/content", params={"path": "a.bin", "tier": "nvme"}, content=b"x")
    routes = _int_path_routes(api)
    assert ("GET", "/v1/files/{file_id}") in routes and (
        "DELETE",
        "/v1/files/{file_id}/pin",
    ) in routes
    before = disk_snapshot(tmp_path / "data")
    for method, path in routes:
        for bad in (HUGE, str(MAX_ID + 1), "-1", "0"):
            url = re.sub(r"\{[a-z_]+\}", bad, path)
            _is_error(api.request(method, url), 404, 422)
        # The largest id there can be is in range: an honest 404.
        _is_error(api.request(method, re.sub(r"\{[a-z_]+\}", str(MAX_ID), path)), 404)
    assert disk_snapshot(tmp_path / "data") == before
    assert api.get("/v1/files").json()["items"][0]["path"] == "a.bin"


def test_openapi_declares_bounds_and_errors(api: TestClient) -> None:
    spec = api.get("/openapi.json").json()
    op = spec["paths"]["/v1/files/{file_id}"]["get"]
    (param,) = [p for p in op["parameters"] if p["name"] == "file_id"]
    assert param["schema"]["maximum"] == MAX_ID and param["schema"]["minimum"] == 1
    ref = op["responses"]["404"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith("/ErrorBody")
    error = spec["components"]["schemas"]["ErrorBody"]["properties"]["error"]
    assert error["$ref"].endswith("/ErrorDetail")
    detail = spec["components"]["schemas"]["ErrorDetail"]
    assert {"code", "message"} <= set(detail["required"])
    mig = spec["paths"]["/v1/migrations"]["get"]
    (fid,) = [p for p in mig["parameters"] if p["name"] == "file_id"]
    assert any(s.get("maximum") == MAX_ID for s in fid["schema"].get("anyOf", [fid["schema"]]))
    # Every operation that takes an id in its path can answer 404 with the error body.
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            if any(p["in"] == "path" for p in op.get("parameters", [])):
                assert "404" in op["responses"], (method, path)
                assert "ErrorBody" in str(op["responses"]["404"]), (method, path)


def test_allow_lists_every_method_of_the_path(api: TestClient) -> None:
    from starlette.exceptions import HTTPException
    from starlette.requests import Request

    from app.api.allow import allow_headers

    scope = {"type": "http", "method": "PATCH", "path": "/v1/files/1", "app": api.app}
    scope["query_string"], scope["headers"] = b"", []
    headers = allow_headers(Request(scope), HTTPException(405, headers={"Allow": "GET"}))
    assert headers is not None and headers["Allow"] == "DELETE, GET, HEAD"


def test_huge_ids_in_bodies_and_405_allow(api: TestClient) -> None:
    huge = 52267692380743628187743025102848
    for path, body in [
        ("/v1/migrations", {"file_id": huge, "to_tier": "ssd"}),
        ("/v1/load", {"file_id": huge, "device": "cpu"}),
        ("/v1/prefetch", {"file_ids": [huge], "target": "page_cache"}),
    ]:
        r = api.post(path, json=body)
        assert r.status_code == 422, (path, r.status_code, r.text)
        assert r.json()["error"]["code"] == "invalid_request"
    r = api.put("/v1/files/1")
    assert r.status_code == 405
    assert set(r.headers["allow"].replace(" ", "").split(",")) >= {"GET", "DELETE"}
