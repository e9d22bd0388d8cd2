"""Tokens: 401 without or with a wrong token, 403 for the data token on admin routes."""

from __future__ import annotations

import pytest

from app.main import UnsafeBind, create_app
from tests.conftest import LiveServer, disk_snapshot, make_settings

ADMIN, DATA = "admin-secret-token", "data-secret-token"


@pytest.fixture
def secured(data_dir):
    settings = make_settings(data_dir, admin_token=ADMIN, data_token=DATA)
    with LiveServer(settings) as srv:
        yield srv


def test_tokens(secured: LiveServer, data_dir) -> None:
    with secured.client(DATA) as data, secured.client(ADMIN) as admin, secured.client() as anon:
        assert anon.get("/healthz").status_code == 200  # liveness needs no token
        r = anon.get("/v1/files")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
        with secured.client("wrong") as bad:
            assert bad.get("/v1/tiers").status_code == 401
        r = anon.get("/v1/files", headers={"Authorization": "Basic Zm9vOmJhcg=="})
        assert r.status_code == 401

        up = data.put("/v1/files/content", params={"path": "f.bin"}, content=b"x")
        assert up.status_code == 201
        fid = up.json()["id"]
        assert data.get(f"/v1/files/{fid}/content").content == b"x"
        before = disk_snapshot(data_dir)
        r = data.delete(f"/v1/files/{fid}")
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
        assert disk_snapshot(data_dir) == before
        assert anon.delete(f"/v1/files/{fid}").status_code == 401
        assert admin.delete(f"/v1/files/{fid}").status_code == 200
        assert admin.get("/v1/tiers").status_code == 200


def test_refuses_open_bind_without_tokens(data_dir) -> None:
    with pytest.raises(UnsafeBind):
        create_app(make_settings(data_dir, host="0.0.0.0"))
    with pytest.raises(UnsafeBind):
        create_app(make_settings(data_dir, host="192.0.2.7"))
    create_app(make_settings(data_dir, host="0.0.0.0", admin_token=ADMIN))
    create_app(make_settings(data_dir, host="::1"))
    create_app(make_settings(data_dir, host="localhost"))
