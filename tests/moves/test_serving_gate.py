"""Moves yield to serving (issue 28): while a request is being served, a move rests after each
chunk it copies and once at its end (:class:`~tiering.moves.ServingGate`); with no request it
never rests. ``tierd bench serving`` measures what that gives; these tests prove the mechanism,
counting rests, never timing them."""

from __future__ import annotations

import threading

import pytest

from tests.helpers import checksum, payload, put, tier_files
from tiering.engine import Engine
from tiering.moves import ServingGate

CHUNK = 64 << 10
SIZE = 5 * CHUNK - 1000  # five chunks, the last one short


@pytest.fixture
def gate(eng: Engine) -> ServingGate:
    # A request counts as in flight for an hour: a slow host cannot make it stale mid-move.
    eng.mover.gate.active_s = 3600.0
    eng.mover.chunk_size = CHUNK
    return eng.mover.gate


def _move_while(eng: Engine, relpath: str, serve: str | None) -> None:
    """Move ``relpath`` to ssd; with ``serve``, that file is read as the first chunk lands."""

    def hook(step: str) -> None:
        if step == "copying" and serve is not None:
            # A request arriving mid-move, through the path every read and load takes.
            content = eng.open_content(eng.lookup(serve).id)
            try:
                assert b"".join(content.iter_range(0, 4096)) == b"s" * 4096
            finally:
                content.close()

    eng.mover.hook = hook
    try:
        eng.migrate(eng.lookup(relpath).id, "ssd")
    finally:
        eng.mover.hook = None


def test_a_move_rests_after_every_chunk_and_at_its_end_while_a_request_is_served(
    eng: Engine, gate: ServingGate
) -> None:
    data = payload(SIZE)
    put(eng, "moving.bin", data)
    put(eng, "served.bin", b"s" * 8192)
    assert not gate.busy() and gate.rests == 0  # nothing was served yet
    _move_while(eng, "moving.bin", serve="served.bin")
    assert gate.busy()
    assert gate.rests == 5 + 1  # one per chunk from the first on, one for the other steps
    assert gate.rested_s > 0
    rec = eng.lookup("moving.bin")
    assert rec.tier == "ssd" and rec.checksum == checksum(data)
    assert tier_files(eng) == {"moving.bin": ["ssd"], "served.bin": ["nvme"]}


def test_a_move_with_no_request_served_never_rests(eng: Engine, gate: ServingGate) -> None:
    data = payload(SIZE)
    put(eng, "moving.bin", data)
    _move_while(eng, "moving.bin", serve=None)
    assert not gate.busy() and gate.rests == 0 and gate.rested_s == 0
    assert eng.lookup("moving.bin").checksum == checksum(data)


def test_share_zero_turns_the_rests_off(eng: Engine, gate: ServingGate) -> None:
    put(eng, "moving.bin", payload(SIZE))
    put(eng, "served.bin", b"s" * 8192)
    gate.share = 0
    _move_while(eng, "moving.bin", serve="served.bin")
    assert gate.busy() and gate.rests == 0
    assert eng.lookup("moving.bin").tier == "ssd"


def test_a_rest_is_cut_short_by_cancel_and_bounded() -> None:
    gate = ServingGate(active_s=3600.0)
    gate.touch()
    cancel = threading.Event()
    cancel.set()
    # Asked to rest for an hour's work: the rest is capped, and a set cancel returns at once.
    assert gate.rest(3600.0, cancel) == ServingGate.MAX_REST_S
    assert gate.rests == 1
    assert gate.rest(0.0, cancel) == 0.0  # no work, no rest
