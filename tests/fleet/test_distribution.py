"""Fleet distribution: real tierd processes on one PostgreSQL catalog, the bucket (moto) behind a
proxy that is its own account of what it sent. Fleet prefetches fill host copies from peers'
verified pieces; the bucket sends the model about once; every host ends with the bucket's
bytes; the faults of issue 26 each complete: a serving peer killed -9, a peer whose copy rotted
(caught by the digest), the object overwritten during a distribution (no host keeps or serves
old bytes), the bucket down while peers hold the model (a host outside the first job warms
from them), a receiver killed -9 (its temp swept, its holding reset at restart). The kill -9
tests run with --runslow (about 50 s each on the 2-core CI box)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.fleet.procs import TierdProcess, fleet_of
from tests.s3_faults import FaultProxy
from tiering.catalog.db import Database
from tiering.catalog.pieces import Pieces
from tiering.tiers.paths import RESERVED_DIR, TEMP_SUFFIX

TOKEN = "fleet-distribution-credential"
MiB = 1 << 20
MODEL = {"llm/a.bin": os.urandom(20 * MiB + 5), "llm/b.bin": os.urandom(12 * MiB + 3)}
SIZE = sum(len(v) for v in MODEL.values())


def _origin_bytes(proxy: FaultProxy, bucket: str) -> int:
    """What the bucket sent of the model's objects, by its own account."""
    return sum(n for path, n in proxy.sent.items() if path.startswith(f"/{bucket}/models/"))


def _start(p: TierdProcess, hosts: list[str]) -> int:
    with p.client() as c:
        body = {"paths": list(MODEL), "hosts": hosts, "target": "nvme"}
        r = c.post("/v1/fleet/prefetch", json=body)
        assert r.status_code == 202, r.text
        job: int = r.json()["id"]
        return job


def _end(p: TierdProcess, job: int) -> dict[str, Any]:
    with p.client() as c:

        def done() -> dict[str, Any] | None:
            doc: dict[str, Any] = c.get(f"/v1/fleet/jobs/{job}").json()
            return doc if doc["state"] not in ("queued", "running") else None

        doc: dict[str, Any] = wait_for(done, timeout=120, what="the fleet prefetch")
        return doc


def _prefetch(p: TierdProcess, hosts: list[str]) -> dict[str, Any]:
    doc = _end(p, _start(p, hosts))
    assert doc["state"] == "done", doc
    return doc


def _served(p: TierdProcess, path: str) -> bytes:
    """The bytes ``p`` holds verified of ``path``'s current generation, as it serves peers."""
    with p.client() as c:
        gen = c.get("/v1/files/lookup", params={"path": path}).json()["generation"]
        r = c.get(
            "/v1/peer/content",
            params={"path": path, "generation": gen},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
    assert r.status_code == 200, r.text
    assert r.headers["x-tierd-source"] == "copy"
    return r.content


def _sources(doc: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {t["host"]: t["sources"] for t in doc["hosts"]}


@pytest.fixture
def origin(
    fault_proxy: FaultProxy, s3_client: Any, s3_bucket: str, s3_env: Any
) -> Iterator[FaultProxy]:
    for rel, data in MODEL.items():
        s3_client.put_object(Bucket=s3_bucket, Key=f"models/{rel}", Body=data)
    yield fault_proxy


def _fleet(base: Path, n: int, pg_url: str, origin: FaultProxy, bucket: str) -> Any:
    return fleet_of(
        base, n, catalog_url=pg_url, endpoint=origin.url, bucket=bucket,
        settings={"fleet_token": TOKEN, "fleet_poll_interval_s": 0.1, "host_timeout_s": 5.0},
    )  # fmt: skip


def test_the_bucket_sends_the_model_about_once_and_a_host_warms_from_peers_while_it_is_down(
    tmp_path: Path, pg_url: str, origin: FaultProxy, s3_bucket: str
) -> None:
    with _fleet(tmp_path, 4, pg_url, origin, s3_bucket) as hosts:
        doc = _prefetch(hosts[0], ["host-0", "host-1", "host-2"])
        sent = _origin_bytes(origin, s3_bucket)
        assert sent <= 1.3 * SIZE, f"the bucket sent {sent / SIZE:.2f}x the model"
        for p in hosts[:3]:
            for path, data in MODEL.items():
                assert _served(p, path) == data
        # Each host's task says where its bytes came from, and they add up to the model.
        sources = _sources(doc)
        assert all(sum(s.values()) == SIZE for s in sources.values()), sources
        assert sum(s.get("bucket", 0) for s in sources.values()) <= 1.3 * SIZE
        assert any(k.startswith("peer:") for s in sources.values() for k in s), sources

        # The bucket goes down: host 3, outside the first job, warms from its peers.
        origin.fail("503", times=10**6)
        doc = _prefetch(hosts[0], ["host-3"])
        for path, data in MODEL.items():
            assert _served(hosts[3], path) == data
        got = _sources(doc)["host-3"]
        assert "bucket" not in got and sum(got.values()) == SIZE, got


@pytest.mark.slow  # four and three processes killed and restarted: --runslow
def test_a_rotten_peer_is_caught_and_killed_ones_replaced(
    tmp_path: Path, pg_url: str, origin: FaultProxy, s3_bucket: str
) -> None:
    with _fleet(tmp_path, 4, pg_url, origin, s3_bucket) as hosts:
        h0, h1, h2, h3 = hosts
        _prefetch(h0, ["host-0", "host-1"])
        # Host 0's copy rots on its disk (a byte of piece 1 of a.bin): it serves wrong bytes.
        with h0.client() as c:
            rec = c.get("/v1/files/lookup", params={"path": "llm/a.bin"}).json()
        copy = h0.root / "nvme" / RESERVED_DIR / f"{rec['id']}.{rec['generation']}"
        with copy.open("r+b") as f:
            f.seek(9 * MiB)
            good = f.read(1)
            f.seek(9 * MiB)
            f.write(bytes([good[0] ^ 0xFF]))
        # Host 1, the other holder, is killed -9 (its catalog rows still say it holds all).
        h1.kill9()
        doc = _prefetch(h0, ["host-2"])
        for path, data in MODEL.items():
            assert _served(h2, path) == data  # the bad piece never landed
        # The rotten piece was dropped and fetched again: from the bucket, the one source
        # left for it (host 0 avoided after its bad piece, host 1 down).
        got = _sources(doc)["host-2"]
        assert got.get("bucket", 0) >= 8 * MiB and sum(got.values()) == SIZE, got
        # Host 3 fills while host 2, serving it, is killed -9: only the missing pieces are
        # fetched again, from host 0 or the bucket.
        job = _start(h0, ["host-3"])
        wait_for(lambda: _end_soon(h0, job), timeout=60, what="host 3's first bytes")
        h2.kill9()
        assert _end(h0, job)["state"] == "done"
        for path, data in MODEL.items():
            assert _served(h3, path) == data
        sent = _origin_bytes(origin, s3_bucket)
        assert sent <= 3 * SIZE, f"the bucket sent {sent / SIZE:.2f}x the model"


def _end_soon(p: TierdProcess, job: int) -> bool:
    """Whether the job's host has done some bytes (or it ended)."""
    with p.client() as c:
        doc = c.get(f"/v1/fleet/jobs/{job}").json()
    return bool(doc["bytes_done"]) or doc["state"] not in ("queued", "running")


def test_an_object_overwritten_during_a_distribution_leaves_no_old_bytes(
    tmp_path: Path, pg_url: str, origin: FaultProxy, s3_bucket: str, s3_client: Any
) -> None:
    with _fleet(tmp_path, 3, pg_url, origin, s3_bucket) as hosts:
        h0, h1, h2 = hosts
        _prefetch(h0, ["host-0"])
        with h0.client() as c:
            old = c.get("/v1/files/lookup", params={"path": "llm/a.bin"}).json()
            job = _start(h0, ["host-1", "host-2"])
            new = os.urandom(len(MODEL["llm/a.bin"]))
            s3_client.put_object(Bucket=s3_bucket, Key="models/llm/a.bin", Body=new)
            assert c.post("/v1/scan").status_code == 200
            now = c.get("/v1/files/lookup", params={"path": "llm/a.bin"}).json()
            assert now["generation"] > old["generation"]
        _end(h0, job)
        # Whatever the first job met, one more warms every host with the new bytes only.
        _prefetch(h0, ["host-0", "host-1", "host-2"])
        for p in hosts:
            assert _served(p, "llm/a.bin") == new
            with p.client() as c:
                r = c.get(
                    "/v1/peer/content",
                    params={"path": "llm/a.bin", "generation": old["generation"]},
                    headers={"Authorization": f"Bearer {TOKEN}"},
                )
                assert r.status_code == 409
        db = Database(pg_url)
        try:
            pieces = Pieces(db)
            assert pieces.map(old["id"], old["generation"]) is None
            held = pieces.holdings(old["id"], old["generation"])
            assert held == []
            assert {h.host for h in pieces.holdings(now["id"], now["generation"])} == {
                "host-0",
                "host-1",
                "host-2",
            }
        finally:
            db.dispose()


@pytest.mark.slow  # four and three processes killed and restarted: --runslow
def test_a_receiver_killed_mid_fill_leaves_a_cache_recovery_sweeps(
    tmp_path: Path, pg_url: str, origin: FaultProxy, s3_bucket: str
) -> None:
    with _fleet(tmp_path, 3, pg_url, origin, s3_bucket) as hosts:
        h0, h1, _ = hosts
        _prefetch(h0, ["host-0"])
        area = h1.root / "nvme" / RESERVED_DIR
        job = _start(h0, ["host-1"])
        wait_for(lambda: area.is_dir() and any(area.iterdir()), timeout=60, what="host 1's fill")
        h1.kill9()
        h1.start()
        # At restart the temp is gone, and host 1's holdings are exactly its copies, whole.
        assert not list(area.glob(f"*{TEMP_SUFFIX}"))
        with h1.client() as c:
            recs = [c.get("/v1/files/lookup", params={"path": p}).json() for p in MODEL]
        db = Database(pg_url)
        try:
            pieces = Pieces(db)
            for rec in recs:
                holding = pieces.holding(rec["id"], "host-1")
                if holding is not None:
                    assert (area / f"{rec['id']}.{rec['generation']}").exists()
                    assert holding.pieces == -(-rec["size"] // (8 * MiB))
        finally:
            db.dispose()
        # The task it was running is taken again at its restart and ends with the right bytes.
        assert _end(h0, job)["state"] == "done"
        for path, data in MODEL.items():
            assert _served(h1, path) == data
