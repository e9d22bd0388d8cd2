"""PostgreSQL down under a real tierd (uvicorn on loopback, directory tiers): loads of files it
read before keep their bytes, ``/readyz`` says ``degraded`` and why, writes are a JSON 503 that
leave nothing behind; when the same server comes back on the same data directory and port, the
accesses counted meanwhile reach the catalog once and the scheduler moves again.

The PostgreSQL server is the test's own (the session's shared one is never stopped)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import LiveServer, disk_snapshot, make_settings, wait_for
from tests.pg_support import PausablePg
from tierd_client import Client

A = bytes(range(256)) * 64 + b"tail"  # 16 KiB + 4
B = b"b" * 3000
HOT = 4  # reads of a before the outage; the policy wants 6 (5 + 20 % hysteresis) for ssd
DOWN_READS = 4  # and these, counted while PostgreSQL is down, take it past


@pytest.fixture
def server(tmp_path: Path, private_pg: PausablePg) -> Iterator[LiveServer]:
    settings = make_settings(
        tmp_path / "data",
        host_id="host-a",
        catalog_url=private_pg.url(private_pg.create_database()),
        watch=False,
        heartbeat_interval_s=0.1,
        access_flush_interval_s=0.05,
        buffers={"cpu_budget_bytes": 8 << 20},
    )
    with LiveServer(settings) as srv:
        yield srv


def _access_count(c: httpx.Client, fid: int) -> int:
    return int(c.get(f"/v1/files/{fid}").json()["access_count"])


def _moves(c: httpx.Client) -> list[tuple[int, str]]:
    return [(m["file_id"], m["state"]) for m in c.get("/v1/migrations").json()["items"]]


def test_postgresql_down_then_back(server: LiveServer, private_pg: PausablePg) -> None:
    root = server.settings.data_dir
    with server.client() as c, Client(server.url) as api:
        ids = {}
        for rel, data in (("m/a.bin", A), ("m/b.bin", B)):
            r = c.put("/v1/files/content", params={"path": rel, "tier": "hdd"}, content=data)
            assert r.status_code == 201, r.text
            ids[rel] = r.json()["id"]
        a = ids["m/a.bin"]
        policy = c.get("/v1/policy").json()["policy"]
        policy["tiers"]["ssd"]["min_heat"] = 5
        policy |= {"min_age_s": 0, "interval_s": 0.1}
        assert c.put("/v1/policy", json=policy).status_code == 200
        # Read a (by id and by path) while PostgreSQL answers; b is never read.
        for _ in range(HOT // 2):
            assert c.get(f"/v1/files/{a}/content").content == A
            with api.load("m/a.bin") as buf:
                assert np.asarray(buf).tobytes() == A
        wait_for(lambda: _access_count(c, a) == HOT, what="the accesses before the outage")
        assert c.get(f"/v1/files/{a}").json()["tier"] == "hdd"
        before = disk_snapshot(root)

        private_pg.halt()
        # Loads of what was read answer from the last known records, with the right bytes.
        r = c.get(f"/v1/files/{a}/content", headers={"Range": "bytes=250-300"})
        assert r.status_code == 206, r.text
        assert r.content == A[250:301]
        with api.load("m/a.bin") as buf:
            assert np.asarray(buf).tobytes() == A
        with api.load(a, offset=16384, length=4) as buf:
            assert np.asarray(buf).tobytes() == b"tail"
        assert c.get(f"/v1/files/{a}/content").content == A
        # A file this process never read has no known record: a clear 503, never a guess.
        r = c.get(f"/v1/files/{ids['m/b.bin']}/content")
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        # Readiness says degraded (still 200: the host keeps serving loads), and why.
        r = c.get("/readyz")
        assert r.status_code == 200, r.text
        ready = r.json()
        assert ready["status"] == "degraded" and ready["checks"]["catalog"]["ok"] is False
        [why] = ready["degraded"]
        assert why["component"] == "catalog" and "cannot be reached" in why["reason"]
        assert "moves and fleet jobs paused" in why["still_works"] and why["since"]
        # A write is a JSON 503 naming the catalog, and leaves nothing on disk.
        r = c.put("/v1/files/content", params={"path": "m/new.bin"}, content=b"x" * 100)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "unavailable" and "catalog" in err["message"]
        r = c.delete(f"/v1/files/{a}")
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        assert disk_snapshot(root) == before  # the scheduler moved nothing either

        private_pg.resume()
        # The accesses counted while it was down arrive, once; the scheduler then promotes a.
        want = HOT + DOWN_READS
        wait_for(lambda: _access_count(c, a) >= want, what="the accesses kept during the outage")
        assert _access_count(c, a) == want
        wait_for(lambda: c.get(f"/v1/files/{a}").json()["tier"] == "ssd", what="the move")
        assert c.get("/readyz").json()["status"] == "ready"
        files = {f["path"]: f for f in c.get("/v1/files").json()["items"]}
        assert set(files) == {"m/a.bin", "m/b.bin"}
        assert (root / "ssd/m/a.bin").read_bytes() == A and not (root / "hdd/m/a.bin").exists()
        # One move, done: nothing ran twice, and nothing was left open by the outage.
        wait_for(lambda: _moves(c) == [(a, "done")], what="the move's intent closed")
        assert c.get(f"/v1/files/{ids['m/b.bin']}/content").content == B
