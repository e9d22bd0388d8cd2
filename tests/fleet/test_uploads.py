"""The peer service (``tiering.fleet.PeerUploads``) on a real engine: which verified bytes serve a
range, and the upload slots, held from the choice of source until the body ends however it ends.

The HTTP side (``GET /v1/peer/content``: 404, 409, 416, 429 and the stream) is covered over real
tierd processes in ``test_peer_content.py``; here each release path is checked one by one.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import engine_settings, put
from tiering.engine import Engine
from tiering.fleet import MAX_UPLOADS, PeerUploads
from tiering.fleet.peerfetch import NotHeld, PeerBusy


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    e = Engine(engine_settings(tmp_path).engine_config()).start()
    try:
        yield e
    finally:
        e.stop()


def _peers(engine: Engine) -> PeerUploads:
    assert engine.peers is not None
    return engine.peers


def test_a_range_of_the_hosts_own_file_is_served_from_its_tier(engine: Engine) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB: more than one chunk is not needed, one is enough
    rec = put(engine, "own/a.bin", data)
    body = _peers(engine).open(rec, 1000, 300_000)
    counted: list[int] = []
    got = b"".join(body.stream(counted.append))
    assert (body.source, got, sum(counted)) == ("tier", data[1000:300_000], 299_000)


def test_the_slots_are_held_until_each_body_ends_however_it_ends(engine: Engine) -> None:
    rec = put(engine, "own/b.bin", b"b" * 4096)
    peers = _peers(engine)
    bodies = [peers.open(rec, 0, 4096) for _ in range(MAX_UPLOADS)]
    with pytest.raises(PeerBusy):
        peers.open(rec, 0, 4096)
    # Sent to the end: its slot comes back.
    assert b"".join(bodies.pop().stream(lambda n: None)) == b"b" * 4096
    bodies.append(peers.open(rec, 0, 4096))
    # Cut off by the client after its first chunk: closing the stream gives the slot back.
    cut = bodies.pop().stream(lambda n: None)
    next(cut)
    cut.close()
    bodies.append(peers.open(rec, 0, 4096))
    # Never started: the stream is collected, and its slot comes back with it.
    unsent = bodies.pop().stream(lambda n: None)
    del unsent
    gc.collect()
    bodies.append(peers.open(rec, 0, 4096))
    # Released by hand (a reply that failed before it streamed): once, however often called.
    last = bodies.pop()
    last.release()
    last.release()
    bodies.append(peers.open(rec, 0, 4096))
    with pytest.raises(PeerBusy):
        peers.open(rec, 0, 4096)
    for b in bodies:
        b.release()
    peers.open(rec, 0, 4096).release()


def test_nothing_held_is_not_held_and_takes_no_slot(engine: Engine) -> None:
    rec = put(engine, "own/c.bin", b"c" * 10)
    elsewhere = rec.__class__(**{**_columns(rec), "host": "another-host"})
    peers = _peers(engine)
    for _ in range(MAX_UPLOADS + 1):
        with pytest.raises(NotHeld):
            peers.open(elsewhere, 0, 10)
    peers.open(rec, 0, 10).release()


def _columns(rec: object) -> dict[str, object]:
    table = rec.__table__  # type: ignore[attr-defined]
    return {c.key: getattr(rec, c.key) for c in table.columns}
