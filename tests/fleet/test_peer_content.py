"""Peers serve what they hold (``GET /v1/peer/content``): three real tierd processes on one
PostgreSQL catalog and one bucket (moto). A host serves byte ranges of its verified copy of a
shared file, and of its own files, only at the generation asked for (409
``generation_mismatch`` otherwise, also after the object was overwritten and rescanned: never
old bytes), nothing it does not hold (404 ``not_held``), and nothing without the fleet
credential (401); a receiver checks each piece against the catalog's piece map, and a peer
whose copy rotted on disk is caught by the digest. In-process: a memory-tier copy is served
from memory; a host with no fleet credential serves no peer reads; bad parameters are 4xx."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LiveServer, free_port, make_settings, wait_for
from tests.fleet.procs import TierdProcess, fleet_of
from tiering.catalog.db import Database
from tiering.catalog.pieces import PieceDigests, Pieces
from tiering.fleet.peerfetch import (
    NotHeld,
    PeerFailed,
    PeerHttp,
    StaleGeneration,
    fetch_piece,
    fetch_range,
)
from tiering.fleet.pieces import ALGORITHM, BadPiece, digest, spans
from tiering.tiers.paths import RESERVED_DIR

TOKEN = "fleet-secret-credential"
MiB = 1 << 20
MODEL = {"llm/a.bin": os.urandom(3 * MiB + 11), "llm/b.bin": os.urandom(5000)}


def _peer(c: httpx.Client, path: str, generation: int, **headers: str) -> httpx.Response:
    auth = {"Authorization": f"Bearer {TOKEN}"} | headers
    return c.get("/v1/peer/content", params={"path": path, "generation": generation},
                 headers=auth)  # fmt: skip


def _record(c: httpx.Client, path: str) -> dict[str, Any]:
    r = c.get("/v1/files/lookup", params={"path": path})
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


@pytest.fixture
def three(
    tmp_path: Path, pg_url: str, moto_endpoint: str, s3_bucket: str, s3_client: Any, s3_env: Any
) -> Iterator[list[TierdProcess]]:
    for rel, data in MODEL.items():
        s3_client.put_object(Bucket=s3_bucket, Key=f"models/{rel}", Body=data)
    with fleet_of(
        tmp_path, 3, catalog_url=pg_url, endpoint=moto_endpoint, bucket=s3_bucket,
        settings={"fleet_token": TOKEN, "fleet_poll_interval_s": 0.1},
    ) as procs:  # fmt: skip
        yield procs


def _prefetch_on(p: TierdProcess, host: str) -> None:
    with p.client() as c:
        body = {"paths": list(MODEL), "hosts": [host], "target": "nvme"}
        r = c.post("/v1/fleet/prefetch", json=body)
        assert r.status_code == 202, r.text
        job = r.json()["id"]

        def done() -> dict[str, Any] | None:
            doc: dict[str, Any] = c.get(f"/v1/fleet/jobs/{job}").json()
            return doc if doc["state"] not in ("queued", "running") else None

        doc = wait_for(done, timeout=60, what="the prefetch")
        assert doc["state"] == "done", doc


def test_peer_reads_on_three_hosts(
    three: list[TierdProcess], s3_client: Any, s3_bucket: str, pg_url: str
) -> None:
    """Three parts on one fleet (suite time: a fleet of three takes about 15 s to start)."""
    _content_reads_of_a_host_without_a_copy_use_its_peers(three)
    _a_receiver_checks_each_piece_and_a_corrupted_one_is_caught(three, pg_url)
    _a_peer_serves_its_verified_copy_at_the_generation_asked(three, s3_client, s3_bucket)


def _content_reads_of_a_host_without_a_copy_use_its_peers(three: list[TierdProcess]) -> None:
    """GET /v1/files/{id}/content of a shared file on a host without a copy reads a peer's
    (issue 42): the bucket is not asked, the header says so, the bytes are the file's."""
    h0, h1, _ = three
    _prefetch_on(h0, "host-0")
    data = MODEL["llm/a.bin"]
    with h1.client() as c1:
        fid = _record(c1, "llm/a.bin")["id"]
        r = c1.get(f"/v1/files/{fid}/content", headers={"Range": "bytes=1000-70999"})
        assert r.status_code == 206 and r.content == data[1000:71000]
        assert r.headers["x-tierd-source"] == "peer"
        r = c1.get(f"/v1/files/{fid}/content")
        assert r.content == data and r.headers["x-tierd-source"] == "peer"


def _a_receiver_checks_each_piece_and_a_corrupted_one_is_caught(
    three: list[TierdProcess], pg_url: str
) -> None:
    h0, h1, _ = three
    _prefetch_on(h0, "host-0")
    data = MODEL["llm/a.bin"]
    with h0.client() as c0:
        rec = _record(c0, "llm/a.bin")
    # The fill recorded the generation's map from the bucket's bytes, final once it matched.
    db = Database(pg_url)
    try:
        recorded = Pieces(db).map(rec["id"], rec["generation"])
    finally:
        db.dispose()
    assert recorded is not None and recorded.final and recorded.recorded_by == "host-0"
    assert recorded.digests == (digest(data),)  # one 8 MiB piece
    # Smaller pieces make the test's point (1 MiB: four, the last short).
    digests = [digest(data[o : o + n]) for o, n in spans(len(data), MiB)]
    pieces = PieceDigests(
        rec["id"], rec["generation"], len(data), MiB, ALGORITHM, tuple(digests), "host-0", 0.0
    )
    with PeerHttp(timeout_s=30, connect_s=5, connections=2) as http:
        for i, (o, n) in enumerate(spans(len(data), MiB)):
            assert fetch_piece(http, h0.url, TOKEN, "llm/a.bin", pieces, i) == data[o : o + n]
        with pytest.raises(NotHeld):
            fetch_piece(http, h1.url, TOKEN, "llm/a.bin", pieces, 0)
        with pytest.raises(PeerFailed) as refused:
            fetch_piece(http, h0.url, "not-the-credential", "llm/a.bin", pieces, 0)
        assert refused.value.details["status"] == 401
        with pytest.raises(PeerFailed):
            fetch_piece(http, f"http://127.0.0.1:{free_port()}", TOKEN, "llm/a.bin", pieces, 0)
        # The peer's copy rots on its disk: it serves the wrong bytes, the digest catches them.
        copy = h0.root / "nvme" / RESERVED_DIR / f"{rec['id']}.{rec['generation']}"
        with copy.open("r+b") as f:
            f.seek(2 * MiB + 100)
            good = f.read(1)
            f.seek(2 * MiB + 100)
            f.write(bytes([good[0] ^ 0xFF]))
        with pytest.raises(BadPiece) as bad:
            fetch_piece(http, h0.url, TOKEN, "llm/a.bin", pieces, 2)
        assert bad.value.index == 2
        assert fetch_piece(http, h0.url, TOKEN, "llm/a.bin", pieces, 1) == data[MiB : 2 * MiB]
        with copy.open("r+b") as f:  # healed, for the next part on the same fleet
            f.seek(2 * MiB + 100)
            f.write(good)


def _a_peer_serves_its_verified_copy_at_the_generation_asked(
    three: list[TierdProcess], s3_client: Any, s3_bucket: str
) -> None:
    h0, h1, h2 = three
    _prefetch_on(h0, "host-0")
    with h0.client() as c0, h1.client() as c1, h2.client() as c2:
        rec = _record(c0, "llm/a.bin")
        gen, data = rec["generation"], MODEL["llm/a.bin"]
        r = _peer(c0, "llm/a.bin", gen)
        assert r.status_code == 200 and r.content == data
        assert (r.headers["x-tierd-source"], r.headers["x-tierd-generation"]) == ("copy", str(gen))
        r = _peer(c0, "llm/a.bin", gen, Range="bytes=1048570-2097160")
        assert r.status_code == 206 and r.content == data[1048570:2097161]
        assert r.headers["content-range"] == f"bytes 1048570-2097160/{len(data)}"
        r = _peer(c0, "llm/a.bin", gen, Range=f"bytes={len(data)}-")
        assert r.status_code == 416

        # Host 1 holds nothing of it: the bucket is not its to serve.
        r = _peer(c1, "llm/a.bin", gen)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_held"
        r = _peer(c0, "llm/none.bin", 0)
        assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found"

        # Another generation is refused, with the catalog's current one.
        r = _peer(c0, "llm/a.bin", gen + 1)
        assert r.status_code == 409
        err = r.json()["error"]
        assert (err["code"], err["generation"], err["asked"]) == (
            "generation_mismatch",
            gen,
            gen + 1,
        )

        # The credential: none, a wrong one, or another kind of token is refused.
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
            r = c0.get("/v1/peer/content", params={"path": "llm/a.bin", "generation": gen},
                       headers=headers)  # fmt: skip
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "unauthorized"
            assert r.headers["www-authenticate"] == "Bearer"

        # A host's own file (on its own nvme) is served by that host alone.
        up = c2.put("/v1/files/content", params={"path": "own/x.bin", "tier": "nvme"},
                    content=b"own bytes" * 1000)  # fmt: skip
        assert up.status_code == 201, up.text
        own = up.json()
        r = _peer(c2, "own/x.bin", own["generation"])
        assert r.status_code == 200 and r.content == b"own bytes" * 1000
        assert r.headers["x-tierd-source"] == "tier"
        assert _peer(c0, "own/x.bin", own["generation"]).status_code == 404

        # The object is overwritten and rescanned: the old generation is refused everywhere,
        # and host 0's copy (of the old bytes) is never served as the new generation.
        new = os.urandom(len(data))
        s3_client.put_object(Bucket=s3_bucket, Key="models/llm/a.bin", Body=new)
        assert c1.post("/v1/scan").status_code == 200
        now = _record(c1, "llm/a.bin")["generation"]
        assert now > gen
        r = _peer(c0, "llm/a.bin", gen)
        assert r.status_code == 409 and r.json()["error"]["generation"] == now
        r = _peer(c0, "llm/a.bin", now)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_held"
        # A receiver with the old generation's map is told to start over at the current one.
        old = [digest(data[o : o + n]) for o, n in spans(len(data), MiB)]
        stale = PieceDigests(rec["id"], gen, len(data), MiB, ALGORITHM, tuple(old), "h", 0.0)
        with (
            pytest.raises(StaleGeneration) as info,
            PeerHttp(timeout_s=30, connect_s=5, connections=1) as http,
        ):
            fetch_piece(http, h0.url, TOKEN, "llm/a.bin", stale, 0)
        assert info.value.current == now


# -- in-process: memory, no credential configured, bad input --------------------------------------
@pytest.fixture
def one(tmp_path: Path) -> Iterator[LiveServer]:
    root = tmp_path / "data"
    settings = make_settings(
        root,
        watch=False,
        fleet_token=TOKEN,
        memory_floor_bytes=0,
        tiers=[
            {"name": "ram", "kind": "memory", "quota_bytes": 8 * MiB},
            {"name": "nvme", "path": root / "nvme"},
        ],
    )
    with LiveServer(settings) as srv:
        yield srv


def test_a_memory_copy_is_served_from_memory(one: LiveServer) -> None:
    data = os.urandom(MiB + 3)
    with one.client() as c:
        rec = c.put("/v1/files/content", params={"path": "m.bin"}, content=data).json()
        r = c.post("/v1/prefetch", json={"paths": ["m.bin"], "target": "memory"})
        assert r.status_code == 202, r.text
        wait_for(
            lambda: c.get(f"/v1/jobs/{r.json()['id']}").json()["state"] == "done",
            what="the prefetch into memory",
        )
        got = _peer(c, "m.bin", rec["generation"], Range="bytes=5-1048580")
        assert got.status_code == 206 and got.content == data[5:1048581]
        assert got.headers["x-tierd-source"] == "memory"
        whole = _peer(c, "m.bin", rec["generation"])
        assert whole.status_code == 200 and whole.content == data
        counted = [
            float(line.rpartition(" ")[2])
            for line in c.get("/metrics").text.splitlines()
            if line.startswith('tierd_peer_bytes_served_total{source="memory"}')
        ]
        assert counted == [len(data) - 5 + len(data)]  # the range (to the end), then all
    # Each read let go of the copy again: it can be dropped as before.
    memory = one.server.config.app.state.engine.memory
    entry = memory.tier.get(rec["id"])
    assert entry is not None and entry.refs == 0


@pytest.mark.parametrize(
    ("params", "status"),
    [
        ({"path": "m.bin"}, 422),
        ({"path": "m.bin", "generation": -1}, 422),
        ({"path": "m.bin", "generation": "x"}, 422),
        ({"path": "../etc/passwd", "generation": 0}, 422),
        ({"generation": 0}, 422),
    ],
)
def test_bad_parameters_are_4xx(one: LiveServer, params: dict[str, Any], status: int) -> None:
    with one.client(TOKEN) as c:
        r = c.get("/v1/peer/content", params=params)
        assert r.status_code == status, r.text
        assert "error" in r.json()


def test_a_host_without_a_fleet_credential_serves_no_peer_reads(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "data", watch=False)
    with LiveServer(settings) as srv, srv.client(TOKEN) as c:
        assert c.put("/v1/files/content", params={"path": "f"}, content=b"x").status_code == 201
        r = c.get("/v1/peer/content", params={"path": "f", "generation": 0})
        assert r.status_code == 401 and "no fleet credential" in r.json()["error"]["message"]


def test_a_peer_that_cuts_its_body_short_is_a_failed_peer() -> None:
    """A piece is read beneath urllib3, straight from http.client into its buffer
    (PeerHttp.get): a body that ends before its Content-Length, or runs past the length asked
    for, is PeerFailed, as any broken peer is, and the connection it leaves mid-response is
    closed at once, not kept for the next request (kept, a fleet fill whose peer was killed
    took 15 s instead of 4.5, the bucket sending 1.2x the model)."""
    import socket
    import threading

    closed = threading.Event()  # the client closed a connection

    def serve(sock: socket.socket, body: bytes, done: threading.Event) -> None:
        # Keep-alive: every request on a connection gets the same reply, until the client
        # closes it; then the next connection.
        head = "HTTP/1.1 206 Partial Content\r\nContent-Length: 4096\r\n"
        reply = (head + "X-Tierd-Generation: 0\r\n\r\n").encode() + body
        sock.settimeout(0.1)
        while not done.is_set():
            try:
                conn, _addr = sock.accept()
            except TimeoutError:
                continue
            conn.settimeout(5)
            with conn:
                try:
                    while conn.recv(65536):
                        conn.sendall(reply)
                        if len(body) < 4096:
                            return  # cut short: the peer goes away mid-body
                except OSError:
                    continue
                closed.set()

    # Cut short: 1000 bytes of 4096 announced. Too long: 4096 for 1000 asked (1001 read).
    for body, length in ((b"x" * 1000, 4096), (b"x" * 4096, 1000)):
        sock = socket.create_server(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        done = threading.Event()
        t = threading.Thread(target=serve, args=(sock, body, done), daemon=True)
        t.start()
        closed.clear()
        with PeerHttp(timeout_s=5, connect_s=5, connections=1) as http:
            if len(body) == 4096:
                assert fetch_range(http, url, TOKEN, "a.bin", 0, 0, 4096) == body
                assert not closed.wait(0.3)  # a whole body: the connection is kept
            got = min(len(body), length + 1)
            with pytest.raises(PeerFailed, match=f"{got} bytes, not {length}"):
                fetch_range(http, url, TOKEN, "a.bin", 0, 0, length)
            if len(body) == 4096:
                assert closed.wait(5)  # closed by the client, with the pool still open
                assert fetch_range(http, url, TOKEN, "a.bin", 0, 0, 4096) == body
        done.set()
        t.join(5)
        sock.close()
