"""Loads use peers: three real tierd processes on one PostgreSQL catalog and one bucket (moto),
host 2 reaching the bucket through a fault proxy. Host 0 holds a verified copy of a model; a
load of it on a host that holds nothing reads host 0's copy (``source`` ``peer``), the bucket
sending nothing, each piece checked against the catalog's piece map where there is one; with
the bucket down, host 2 still loads it from host 0; a killed peer is passed over for another
one; a piece that rotted on a peer's disk is caught by its digest and read from the bucket.
A fill of the memory tier takes a peer's pieces too, the bucket down."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from sqlalchemy import delete

from tests.app.test_memory_api import sample
from tests.conftest import wait_for
from tests.fleet.procs import TierdProcess, fleet_of
from tests.s3_faults import FaultProxy
from tierd_client import Client
from tiering.catalog import FileRecord
from tiering.catalog.db import Database
from tiering.catalog.models import PieceHolding, PieceMap
from tiering.catalog.pieces import Pieces
from tiering.errors import FileChanged
from tiering.fleet.peerreader import PeerRanges, PeerReads
from tiering.fleet.pieces import ALGORITHM, digest, spans
from tiering.tiers.paths import RESERVED_DIR

TOKEN = "fleet-secret-credential"
MiB = 1 << 20
MODEL = {"llm/a.bin": os.urandom(3 * MiB + 11), "llm/b.bin": os.urandom(5000)}


@pytest.fixture
def three(
    tmp_path: Path,
    pg_url: str,
    moto_endpoint: str,
    s3_bucket: str,
    s3_client: Any,
    s3_env: Any,
    fault_proxy: FaultProxy,
) -> Iterator[list[TierdProcess]]:
    for rel, data in MODEL.items():
        s3_client.put_object(Bucket=s3_bucket, Key=f"models/{rel}", Body=data)
    with fleet_of(
        tmp_path, 3, catalog_url=pg_url, endpoint=moto_endpoint, bucket=s3_bucket,
        settings={"fleet_token": TOKEN, "fleet_poll_interval_s": 0.1},
        endpoints={2: fault_proxy.url},
    ) as procs:  # fmt: skip
        yield procs


def _job_done(c: httpx.Client, path: str, body: dict[str, Any]) -> None:
    """POST ``body`` to ``path`` (a job-starting route), wait for the job, and check it done."""
    r = c.post(path, json=body)
    assert r.status_code == 202, r.text
    jobs = "/v1/fleet/jobs" if path.startswith("/v1/fleet/") else "/v1/jobs"

    def done() -> dict[str, Any] | None:
        doc: dict[str, Any] = c.get(f"{jobs}/{r.json()['id']}").json()
        return doc if doc["state"] not in ("queued", "running") else None

    doc = wait_for(done, timeout=60, what=f"the job of {path}")
    assert doc["state"] == "done", doc


def _prefetch_on(p: TierdProcess, host: str) -> None:
    with p.client() as c:
        _job_done(c, "/v1/fleet/prefetch",
                  {"paths": list(MODEL), "hosts": [host], "target": "nvme"})  # fmt: skip


def _load(p: TierdProcess, rel: str) -> tuple[str, bytes]:
    """Load ``rel`` into host memory on ``p``: the lease's source and its bytes."""
    with p.client() as c:
        r = c.post("/v1/load", json={"path": rel, "device": "cpu"})
        assert r.status_code == 200, r.text
        lease = r.json()
        with Client(p.url) as api, api.open_buffer(lease["buffer_id"]) as buf:
            data = np.asarray(buf).tobytes()  # the buffer is released as the block ends
    return lease["source"], data


def _metric(p: TierdProcess, series: str) -> float:
    with p.client() as c:
        return sample(c.get("/metrics").text, series) or 0.0


ORIGIN = 'tierd_origin_bytes_read_total{tier="s3"}'
RECEIVED = 'tierd_peer_bytes_received_total{use="load"}'


def test_loads_read_a_peers_copy_even_with_the_bucket_down(
    three: list[TierdProcess],
    pg_url: str,
    fault_proxy: FaultProxy,
    s3_client: Any,
    s3_bucket: str,
) -> None:
    h0, h1, h2 = three
    _prefetch_on(h0, "host-0")
    data = MODEL["llm/a.bin"]
    with h0.client() as c0:
        rec = c0.get("/v1/files/lookup", params={"path": "llm/a.bin"}).json()
    # a.bin's piece map, as the first filling host records it (1 MiB pieces: four, the last
    # short); b.bin has none, and its bytes are the peer's checked copy's.
    db = Database(pg_url)
    try:
        digests = [digest(data[o : o + n]) for o, n in spans(len(data), MiB)]

        # Host 0's fill recorded the map of its 8 MiB pieces (one, here); this test wants a
        # file of several pieces, so the map is recorded again as a filler of 1 MiB pieces
        # would have (the catalog's rows replaced: no API forgets a final map).
        def forget(s: Any) -> None:
            s.execute(delete(PieceHolding).where(PieceHolding.file_id == rec["id"]))
            s.execute(delete(PieceMap).where(PieceMap.file_id == rec["id"]))

        db.transact(forget, changes_files=False)
        Pieces(db).record_map(
            rec["id"], generation=rec["generation"], size=len(data), piece_size=MiB,
            algorithm=ALGORITHM, digests=digests, host="host-0",
        )  # fmt: skip
        # Host 2 is half way through a fill of it: locate shows how far.
        Pieces(db).mark(rec["id"], host="host-2", generation=rec["generation"], verified=[0, 3])
    finally:
        db.dispose()
    with h1.client() as c1:
        [doc] = c1.get("/v1/fleet/locate", params={"path": "llm/a.bin"}).json()["files"]
    assert doc["pieces"] == [
        {"host_id": "host-2", "address": h2.url, "state": "up", "pieces": 2, "total": 4,
         "complete": False}
    ]  # fmt: skip

    # Host 1 holds nothing: it loads host 0's copy, and the bucket sends it nothing.
    origin = _metric(h1, ORIGIN)
    served = _metric(h0, 'tierd_peer_bytes_served_total{source="copy"}')
    for rel, want in MODEL.items():
        assert _load(h1, rel) == ("peer", want)
    total = sum(len(v) for v in MODEL.values())
    assert _metric(h1, ORIGIN) == origin
    assert _metric(h1, RECEIVED) == total
    assert _metric(h0, 'tierd_peer_bytes_served_total{source="copy"}') == served + total

    # The bucket is down for host 2: it still loads the model, from host 0.
    down = fault_proxy.fail("reset", times=1 << 30)
    for rel, want in MODEL.items():
        assert _load(h2, rel) == ("peer", want)
    with fault_proxy.state.lock:
        fault_proxy.state.rules.remove(down)

    # Host 2 takes a copy too, and host 0 is killed. Host 1 asks host 0 first (its order of
    # the two holders), finds it gone (the catalog still shows it up), and reads host 2's copy:
    # the bucket still sends it nothing.
    _prefetch_on(h2, "host-2")
    h0.kill9()
    origin = _metric(h1, ORIGIN)
    assert _load(h1, "llm/a.bin") == ("peer", data)
    assert _metric(h1, ORIGIN) == origin

    # A piece of host 2's copy rots on its disk: its digest catches it on host 1, which reads
    # that piece from the bucket (no other peer is left), and the load's bytes are right.
    copy = h2.root / "nvme" / RESERVED_DIR / f"{rec['id']}.{rec['generation']}"
    with copy.open("r+b") as f:
        f.seek(2 * MiB + 100)
        good = f.read(1)
        f.seek(2 * MiB + 100)
        f.write(bytes([good[0] ^ 0xFF]))
    assert _load(h1, "llm/a.bin")[1] == data
    assert _metric(h1, "tierd_peer_bad_pieces_total") == 1
    assert _metric(h1, ORIGIN) - origin == MiB  # the bad piece alone came from the bucket

    # b.bin is overwritten and rescanned: a reader opened at its old generation is refused by
    # the peer that still has the old bytes (409), and raises FileChanged, never old bytes.
    with h1.client() as c1:
        old = c1.get("/v1/files/lookup", params={"path": "llm/b.bin"}).json()
        s3_client.put_object(Bucket=s3_bucket, Key="models/llm/b.bin", Body=os.urandom(5000))
        assert c1.post("/v1/scan").status_code == 200
        now = c1.get("/v1/files/lookup", params={"path": "llm/b.bin"}).json()["generation"]
        assert now > old["generation"]
    stale = FileRecord(id=old["id"], relpath="llm/b.bin", size=5000, mtime_ns=0,
                       generation=old["generation"])  # fmt: skip
    db = Database(pg_url)
    reads = PeerReads(lambda: db, host_id="host-1", token=TOKEN, host_timeout_s=30.0)
    try:
        reader = PeerRanges(reads, stale, [("host-2", h2.url)], None, None)
        with pytest.raises(FileChanged):
            reader.readinto(memoryview(bytearray(5000)), 0)
        assert reads.bytes_received == 0
    finally:
        reads.close()
        db.dispose()


def test_a_memory_fill_reads_a_peers_copy_with_the_bucket_down(
    tmp_path: Path,
    pg_url: str,
    moto_endpoint: str,
    s3_bucket: str,
    s3_client: Any,
    s3_env: Any,
    fault_proxy: FaultProxy,
) -> None:
    for rel, data in MODEL.items():
        s3_client.put_object(Bucket=s3_bucket, Key=f"models/{rel}", Body=data)
    settings = {"fleet_token": TOKEN, "fleet_poll_interval_s": 0.1, "memory_floor_bytes": 0}
    with fleet_of(
        tmp_path, 2, catalog_url=pg_url, endpoint=moto_endpoint, bucket=s3_bucket,
        settings=settings, endpoints={1: fault_proxy.url}, memory_bytes=16 * MiB,
    ) as (h0, h1):  # fmt: skip
        _prefetch_on(h0, "host-0")
        down = fault_proxy.fail("reset", times=1 << 30)  # host 1 reaches no bucket
        origin = _metric(h1, ORIGIN)
        with h1.client() as c:
            _job_done(c, "/v1/prefetch", {"paths": list(MODEL), "target": "memory"})
        # Through a copy on host 1's disk made from host 0's pieces (see copies.fillsource).
        assert _metric(h1, ORIGIN) == origin
        assert len(list((h1.root / "nvme" / RESERVED_DIR).iterdir())) == len(MODEL)
        # Host 1's memory holds the model, every byte the bucket's, and serves it (a copy of
        # a shared file is current by the catalog's ETag: the bucket is not asked).
        for rel, want in MODEL.items():
            assert _load(h1, rel) == ("memory", want)
        with fault_proxy.state.lock:
            fault_proxy.state.rules.remove(down)
