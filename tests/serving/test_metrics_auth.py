"""``/metrics`` parses as Prometheus text, in base units and without per-file labels; the
buffer routes need the data token and the stats reset the admin token."""

from __future__ import annotations

import httpx
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.main import create_app
from tests.conftest import LiveServer, make_settings
from tierd_client import AuthError, Client


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_parse_and_count(api, upload):
    fid = upload("secret/name.bin", b"m" * 50_000)
    api.load(fid).close()
    api.gather(fid, dim=10, dtype="uint8", indices=[1, 2, 3]).close()
    keep = api.load(fid, length=1000)
    job = api.prefetch(fid, target="page_cache", wait=True, progress=False)
    api.job(job["id"])
    text = api._http.get("/metrics").text
    fams = _families(text)
    loaded = {
        tuple(sorted(s.labels.items())): s.value
        for s in fams["tierd_loaded_bytes"].samples
        if s.name == "tierd_loaded_bytes_total"
    }
    assert (
        loaded[(("device", "cpu"), ("io_path", "host"), ("op", "load"), ("tier", "nvme"))] == 51_000
    )
    assert (
        loaded[(("device", "cpu"), ("io_path", "host"), ("op", "gather"), ("tier", "nvme"))] == 30
    )
    counts = {
        s.labels["op"]: s.value
        for s in fams["tierd_load_duration_seconds"].samples
        if s.name.endswith("_count")
    }
    assert counts == {"load": 2, "gather": 1}
    assert fams["tierd_leased_bytes"].samples[0].value == keep.info["alloc_bytes"]
    assert fams["tierd_lease_budget_bytes"].samples[0].value > 0
    files = {s.labels["tier"]: s.value for s in fams["tierd_catalog_files"].samples}
    assert files["nvme"] == 1 and files["ssd"] == 0
    assert "tierd_migrations" in fams and "tierd_migrations_in_flight" in fams
    routes = {s.labels["route"] for s in fams["tierd_http_requests"].samples}
    assert "/v1/load" in routes and "/v1/vectors/gather" in routes
    assert "/v1/jobs/{job_id}" in routes  # templates, not raw paths
    # No label anywhere names a file or a buffer.
    for fam in fams.values():
        for s in fam.samples:
            for v in s.labels.values():
                assert "secret" not in v and keep.id not in v
    keep.close()


def test_tokens(data_dir):
    settings = make_settings(data_dir, watch=False, admin_token="adm", data_token="dat")
    with TestClient(create_app(settings), base_url="http://127.0.0.1") as c:
        fid = c.put(
            "/v1/files/content",
            params={"path": "a.bin"},
            content=b"a" * 100,
            headers={"Authorization": "Bearer dat"},
        ).json()["id"]
        assert c.post("/v1/load", json={"file_id": fid}).status_code == 401
        assert c.get("/v1/buffers").status_code == 401
        assert c.get("/v1/stats", headers={"Authorization": "Bearer dat"}).status_code == 200
        r = c.post("/v1/stats/reset", headers={"Authorization": "Bearer dat"})
        assert r.status_code == 403
        r = c.post("/v1/stats/reset", headers={"Authorization": "Bearer adm"})
        assert r.status_code == 200
        assert c.get("/metrics").status_code == 200  # like the health probes: no token


def test_client_with_token_and_transport_errors(data_dir):
    settings = make_settings(data_dir, watch=False, admin_token="adm", data_token="dat")
    with LiveServer(settings) as srv:
        with Client(srv.url, "dat") as ok:
            assert [t["name"] for t in ok.tiers()] == ["nvme", "ssd", "hdd"]
            assert ok.files() == [] and "version" in ok.policy()
            http = httpx.Client(base_url=srv.url, headers={"Authorization": "Bearer dat"})
            http.put("/v1/files/content", params={"path": "q.bin"}, content=b"q" * 10)
            http.close()
            assert [f["path"] for f in ok.files(prefix="q")] == ["q.bin"]
            with ok.load("q.bin") as b:
                assert bytes(b.array) == b"q" * 10
        with Client(srv.url, "wrong") as bad:
            try:
                bad.load("q.bin")
            except AuthError as exc:
                assert exc.status == 401 and exc.code == "unauthorized"
            else:
                raise AssertionError("no AuthError")
