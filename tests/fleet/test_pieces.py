"""Pieces as hosts exchange them: split, digest, verify, and the plan of which peer sends which
piece (least busy, then most complete; capped per peer; bad peers avoided a while; the bucket
when no live peer holds a piece)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import xxhash

from tiering.catalog.pieces import Holding, PieceDigests, bitmap
from tiering.fleet.failures import AVOID_MAX_S, AVOID_S, NOT_HELD_S, PEER_RETRY_S, PeerFailures
from tiering.fleet.peerfetch import NotHeld, PeerBusy, PeerFailed
from tiering.fleet.pieces import (
    ALGORITHM,
    BUCKET,
    PIECE_SIZE,
    BadPiece,
    Speeds,
    digest,
    digests_of_fd,
    piece_count,
    piece_span,
    plan_sources,
    spans,
    verify,
)


@pytest.mark.parametrize(
    ("size", "piece", "want"),
    [
        (0, 8, [(0, 0)]),
        (1, 8, [(0, 1)]),
        (8, 8, [(0, 8)]),
        (9, 8, [(0, 8), (8, 1)]),
        (199, 64, [(0, 64), (64, 64), (128, 64), (192, 7)]),
    ],
)
def test_spans_cover_the_file_once(size: int, piece: int, want: list[tuple[int, int]]) -> None:
    assert spans(size, piece) == want and piece_count(size, piece) == len(want)
    assert sum(n for _, n in want) == size


def test_spans_refuse_nonsense() -> None:
    with pytest.raises(ValueError):
        piece_count(-1)
    with pytest.raises(ValueError):
        piece_count(10, 0)
    with pytest.raises(ValueError):
        piece_span(2, 16, 8)
    assert piece_count(PIECE_SIZE * 3 + 1) == 4


def _map(data: bytes, piece: int) -> PieceDigests:
    ds = tuple(digest(data[o : o + n]) for o, n in spans(len(data), piece))
    return PieceDigests(1, 0, len(data), piece, ALGORITHM, ds, "h", 0.0)


def test_digests_of_a_file_match_its_pieces(tmp_path: Path) -> None:
    data = os.urandom(3 * 4096 + 17)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = digests_of_fd(fd, len(data), 4096)
        assert got == list(_map(data, 4096).digests)
        assert got[0] == xxhash.xxh3_128(data[:4096]).digest() and len(got[0]) == 16
        with pytest.raises(BadPiece, match="ends at"):
            digests_of_fd(fd, len(data) + 1, 4096)
    finally:
        os.close(fd)


def test_verify_catches_a_wrong_or_short_piece() -> None:
    data = os.urandom(1000)
    m = _map(data, 300)
    for i, (o, n) in enumerate(spans(1000, 300)):
        verify(m, i, data[o : o + n])
    flipped = bytearray(data[300:600])
    flipped[17] ^= 1
    with pytest.raises(BadPiece, match="piece 1: its bytes") as info:
        verify(m, 1, flipped)
    assert info.value.index == 1
    with pytest.raises(BadPiece, match="bytes, not 100"):
        verify(m, 3, data[900:999])
    with pytest.raises(BadPiece, match="cannot check"):
        verify(PieceDigests(1, 0, 1000, 300, "sha256", m.digests, "h", 0.0), 0, data[:300])


def _holding(host: str, pieces: list[int], count: int = 4, generation: int = 0) -> Holding:
    return Holding(1, host, generation, bitmap(pieces, count), len(pieces), 0.0)


def test_the_plan_spreads_pieces_least_busy_then_most_complete() -> None:
    holdings = [_holding("full", [0, 1, 2, 3]), _holding("half", [0, 1])]
    plan = plan_sources(range(4), holdings, me="me", generation=0, now=0.0)
    # Equally idle: the most complete first; then the load decides.
    assert plan == {0: "full", 1: "half", 2: "full", 3: "full"}
    busy = plan_sources(range(2), holdings, me="me", generation=0, now=0.0, busy={"full": 5})
    assert busy == {0: "half", 1: "half"}


def test_the_plan_gives_a_faster_peer_more_pieces() -> None:
    holdings = [_holding("fast", [0, 1, 2, 3]), _holding("slow", [0, 1, 2, 3])]
    speeds = Speeds(weight=1.0)  # the last measure only, to keep the arithmetic plain
    speeds.record("fast", 300, 1.0)
    speeds.record("slow", 100, 1.0)
    speeds.record("idle", 0, 1.0)  # nothing delivered: no measure
    assert speeds.rates() == {"fast": 300.0, "slow": 100.0}
    plan = plan_sources(range(4), holdings, me="me", generation=0, now=0.0, speed=speeds.rates())
    # "fast" delivers its third piece (3/300) as soon as "slow" its first (1/100).
    assert plan == {0: "fast", 1: "fast", 2: "fast", 3: "slow"}
    # A peer not measured yet counts as the median of the measured: it is tried.
    new = [*holdings, _holding("new", [0, 1, 2, 3])]
    plan = plan_sources(range(4), new, me="me", generation=0, now=0.0, speed=speeds.rates())
    assert "new" in plan.values()
    # The measure follows a peer that slows down.
    speeds = Speeds(weight=0.5)
    speeds.record("p", 100, 1.0)
    speeds.record("p", 50, 1.0)
    assert speeds.rates() == {"p": 75.0}


def test_a_host_that_may_read_the_bucket_takes_it_when_it_is_faster() -> None:
    """Issue 42: the bucket measured faster than the peers is used by a host that holds a
    claim (``bucket``: its reads of it in flight); a slower one only for what no peer has, and
    never by a host without a claim."""
    holdings = [_holding("p", [0, 1, 2, 3]), _holding("q", [0, 1, 2, 3])]
    speeds = Speeds(weight=1.0)
    speeds.record("p", 100, 1.0)
    speeds.record("q", 100, 1.0)
    speeds.record(BUCKET, 300, 1.0)
    rates = speeds.rates()
    claimed = plan_sources(
        range(4), holdings, me="me", generation=0, now=0.0, speed=rates, bucket=0
    )
    # The bucket's third piece (3/300) would come no sooner than a peer's first (1/100).
    assert claimed == {0: None, 1: None, 2: "p", 3: "q"}
    busy = plan_sources(range(4), holdings, me="me", generation=0, now=0.0, speed=rates, bucket=5)
    assert busy == {0: "p", 1: "q", 2: "p", 3: "q"}  # 6/300 is later than 2/100
    unclaimed = plan_sources(range(4), holdings, me="me", generation=0, now=0.0, speed=rates)
    assert None not in unclaimed.values()
    speeds.record(BUCKET, 10, 1.0)  # a slow bucket: only what no peer has
    slow = speeds.rates()
    plan = plan_sources(range(4), holdings, me="me", generation=0, now=0.0, speed=slow, bucket=0)
    assert None not in plan.values()
    # The bucket's rate is not a peer's: an unmeasured peer counts as the peers' median.
    speeds.record(BUCKET, 10_000, 1.0)
    new = [_holding("new", [0])]
    assert plan_sources([0], new, me="me", generation=0, now=0.0, speed=speeds.rates()) == {
        0: "new"
    }


def test_the_plan_falls_back_to_the_bucket() -> None:
    holdings = [
        _holding("me", [0, 1, 2, 3]),  # this host is never its own source
        _holding("old", [0, 1, 2, 3], generation=7),  # another generation: never a source
        _holding("down", [2]),
        _holding("p", [0]),
    ]
    plan = plan_sources([0, 1, 2], holdings, me="me", generation=0, now=0.0, up=["p", "old"])
    assert plan == {0: "p", 1: None, 2: None}
    capped = plan_sources(
        range(4),
        [_holding("p", [0, 1, 2, 3])],
        me="me",
        generation=0,
        now=0.0,
        per_peer=2,
        busy={"p": 1},
    )
    assert capped == {0: "p", 1: None, 2: None, 3: None}


def test_a_peer_that_sent_a_bad_piece_is_avoided_a_while() -> None:
    avoid = PeerFailures()
    holdings = [_holding("bad", [0, 1, 2, 3]), _holding("good", [0])]
    assert avoid.bad_piece("bad", 100.0) == 100.0 + AVOID_S
    plan = plan_sources(range(2), holdings, me="me", generation=0, now=101.0, avoid=avoid)
    assert plan == {0: "good", 1: None}
    later = plan_sources(
        range(2), holdings, me="me", generation=0, now=100.0 + AVOID_S, avoid=avoid
    )
    assert later == {0: "bad", 1: "bad"}
    # Each further offence doubles the time, up to a cap.
    assert avoid.bad_piece("bad", 200.0) == 200.0 + 2 * AVOID_S
    for _ in range(10):
        until = avoid.bad_piece("bad", 300.0)
    assert until == 300.0 + AVOID_MAX_S
    assert avoid.avoided("bad", 300.0 + AVOID_MAX_S - 1) and not avoid.avoided("good", 0.0)
    assert avoid.bad_pieces == 12


def test_one_record_keeps_each_kind_of_failure_for_its_own_time() -> None:
    failures = PeerFailures()
    assert failures.record("down", PeerFailed("refused"), now=10.0) == 10.0 + PEER_RETRY_S
    assert failures.record("busy", PeerBusy("4 uploads"), now=10.0) == 10.0 + NOT_HELD_S
    assert failures.record("lag", NotHeld("not yet"), now=10.0) == 10.0 + NOT_HELD_S
    assert failures.record("bad", BadPiece(3, "mismatch"), now=10.0) == 10.0 + AVOID_S
    assert failures.is_down("down", 10.5) and not failures.is_down("down", 10.0 + PEER_RETRY_S)
    assert failures.is_busy("busy", 10.1) and failures.is_busy("lag", 10.1)
    assert not failures.usable("bad", 10.0 + PEER_RETRY_S)  # avoided far longer
    assert all(failures.usable(h, 10.0 + PEER_RETRY_S) for h in ("down", "busy", "lag", "x"))
    with pytest.raises(ValueError):  # anything but a peer's failure is no record
        failures.record("x", ValueError("a bug"))
