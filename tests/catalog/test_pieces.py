"""The catalog's pieces: migration 0009 up and down on real data; a generation's map written
once, whole, only at that generation, and the first recorder's kept; holdings that grow, are
replaced by a newer generation and vanish with the file. On SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from tests.catalog.conftest import run_sql
from tests.catalog.test_copies import _FILE, _downgrade, _tables
from tiering.catalog.db import Database, upgrade
from tiering.catalog.pieces import Pieces, bitmap, bits_of
from tiering.errors import IntegrityError
from tiering.fleet.pieces import ALGORITHM, PIECE_SIZE, digest

SIZE = 2 * PIECE_SIZE + 5  # three pieces, the last of 5 bytes
DIGESTS = [digest(bytes([i]) * 8) for i in range(3)]


def _map(pieces: Pieces, file_id: int = 1, generation: int = 0, **kw: object) -> object:
    args: dict[str, object] = {
        "generation": generation, "size": SIZE, "piece_size": PIECE_SIZE,
        "algorithm": ALGORITHM, "digests": DIGESTS, "host": "h1",
    } | kw  # fmt: skip
    return pieces.record_map(file_id, **args)  # type: ignore[arg-type]


@pytest.fixture
def db(empty_catalog_url: str) -> Iterator[Database]:
    upgrade(empty_catalog_url)
    for path, state in (("a", "stable"), ("b", "migrating")):
        run_sql(empty_catalog_url, _FILE, {"p": path, "s": state, "g": 0})
    database = Database(empty_catalog_url)
    yield database
    database.dispose()


def test_0009_upgrades_and_downgrades_keeping_the_files(empty_catalog_url: str) -> None:
    url = empty_catalog_url
    upgrade(url, "0008")
    run_sql(url, _FILE, {"p": "a", "s": "stable", "g": 4})
    upgrade(url)
    assert {"piece_maps", "piece_holdings"} <= _tables(url)
    db = Database(url)
    assert _map(Pieces(db), generation=4) is not None
    db.dispose()
    _downgrade(url, "0008")
    assert not {"piece_maps", "piece_holdings"} & _tables(url)
    assert run_sql(url, "SELECT relpath, generation FROM files") == [("a", 4)]
    upgrade(url)
    db = Database(url)
    assert Pieces(db).map(1, 4) is None  # derived from the bytes: recorded again when filled
    db.dispose()


def test_a_map_is_written_once_at_its_generation(db: Database) -> None:
    pieces = Pieces(db)
    assert _map(pieces, generation=7) is None  # the file is at generation 0
    assert _map(pieces, file_id=99) is None  # no such file
    assert _map(pieces, file_id=2, states=["stable"]) is None  # migrating
    first = pieces.record_map(
        1, generation=0, size=SIZE, piece_size=PIECE_SIZE, algorithm=ALGORITHM,
        digests=DIGESTS, host="h1", now=5.0,
    )  # fmt: skip
    assert first is not None and first.count == 3 and first.digests == tuple(DIGESTS)
    assert (first.recorded_by, first.created_at, first.size) == ("h1", 5.0, SIZE)
    # A second recorder gets the first's map back, whatever it read.
    other = [digest(b"other")] * 3
    again = _map(pieces, digests=other, host="h2")
    assert again == first and pieces.map(1, 0) == first
    assert run_sql(db.url, "SELECT count(*) FROM piece_maps") == [(1,)]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"digests": DIGESTS[:2]}, "do not cover"),
        ({"digests": [b"short", *DIGESTS[1:]]}, "16 bytes"),
        ({"algorithm": "md5"}, "unknown"),
        ({"piece_size": 0}, "do not cover"),
    ],
)
def test_a_bad_map_is_refused_before_anything_is_written(
    db: Database, kw: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _map(Pieces(db), **kw)
    assert run_sql(db.url, "SELECT count(*) FROM piece_maps") == [(0,)]


def test_holdings_grow_and_show_partial(db: Database) -> None:
    pieces = Pieces(db)
    assert pieces.mark(1, host="h1", generation=0, verified=[0]) is None  # no map yet
    _map(pieces)
    h = pieces.mark(1, host="h1", generation=0, verified=[2], now=1.0)
    assert h is not None and (h.pieces, h.has(2), h.has(0)) == (1, True, False)
    h = pieces.mark(1, host="h1", generation=0, verified=[0, 2])
    assert h is not None and h.pieces == 2 and bits_of(h.have, 3) == [0, 2]
    pieces.mark(1, host="h2", generation=0, verified=range(3))
    assert [(x.host, x.pieces) for x in pieces.holdings(1, 0)] == [("h2", 3), ("h1", 2)]
    assert pieces.holdings(1, 1) == []
    with pytest.raises(ValueError, match="outside"):
        pieces.mark(1, host="h1", generation=0, verified=[3])
    pieces.forget(1, host="h2")
    assert [x.host for x in pieces.holdings(1, 0)] == ["h1"]


def test_a_new_generation_drops_the_old_maps_and_holdings(db: Database) -> None:
    pieces = Pieces(db)
    _map(pieces)
    pieces.mark(1, host="h1", generation=0, verified=[0, 1, 2])
    run_sql(db.url, "UPDATE files SET generation = 1 WHERE id = 1")  # overwritten, rescanned
    assert pieces.mark(1, host="h2", generation=0, verified=[0]) is None  # stale: refused
    new = [digest(b"new%d" % i) for i in range(3)]
    assert _map(pieces, generation=1, digests=new, host="h2") is not None
    assert pieces.map(1, 0) is None and pieces.holdings(1, 0) == []
    assert pieces.holding(1, "h1") is None
    h = pieces.mark(1, host="h2", generation=1, verified=[1])
    assert h is not None and h.generation == 1


def test_rows_go_with_their_file(db: Database) -> None:
    pieces = Pieces(db)
    _map(pieces)
    pieces.mark(1, host="h1", generation=0, verified=[1])
    with db.write() as s:  # tierd's connection: foreign keys on, on SQLite too
        s.execute(text("DELETE FROM files WHERE id = 1"))
    assert pieces.map(1, 0) is None and pieces.holdings(1, 0) == []
    assert pieces.forget_host("h1") == 0


def test_hosts_marking_at_once_lose_no_piece(db: Database) -> None:
    pieces = Pieces(db)
    count = 3
    _map(pieces)
    errors: list[BaseException] = []

    def mark(i: int) -> None:
        try:
            pieces.mark(1, host="h1", generation=0, verified=[i % count])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=mark, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    h = pieces.holding(1, "h1")
    assert h is not None and bits_of(h.have, count) == [0, 1, 2] and h.pieces == 3


def test_bitmaps() -> None:
    assert bitmap([], 0) == b"" and bitmap([0, 9], 10) == b"\x01\x02"
    assert bits_of(bitmap([0, 7, 8, 15], 16), 16) == [0, 7, 8, 15]
    with pytest.raises(ValueError):
        bitmap([10], 10)


def _open(pieces: Pieces, generation: int = 0, file_id: int = 1) -> object:
    return pieces.open_map(
        file_id, generation=generation, size=SIZE, piece_size=PIECE_SIZE, algorithm=ALGORITHM,
        host="h1",
    )  # fmt: skip


def test_a_map_grows_as_pieces_land_and_is_final_once_whole(db: Database) -> None:
    pieces = Pieces(db)
    opened = _open(pieces)
    assert opened is not None and not pieces.map(1, 0).final  # type: ignore[union-attr]
    assert not any(pieces.map(1, 0).has_digest(i) for i in range(3))  # type: ignore[union-attr]
    assert not pieces.finalize(1, 0)  # digests missing: not final
    m = pieces.land(1, host="h1", generation=0, index=1, digest=DIGESTS[1])
    assert m is not None and m.has_digest(1) and not m.has_digest(0)
    assert m.digests[1] == DIGESTS[1]
    # A piece from a peer adds to the holding, not to the map.
    m = pieces.land(1, host="h2", generation=0, index=1)
    assert m is not None and not m.has_digest(0)
    # Another digest for a known piece: someone read other bytes; refused, nothing written.
    with pytest.raises(IntegrityError):
        pieces.land(1, host="h2", generation=0, index=1, digest=DIGESTS[0])
    for i in (0, 2):
        pieces.land(1, host="h1", generation=0, index=i, digest=DIGESTS[i])
    assert pieces.finalize(1, 0)
    final = pieces.map(1, 0)
    assert final is not None and final.final and list(final.digests) == DIGESTS
    holding = {h.host: h.pieces for h in pieces.holdings(1, 0)}
    assert holding == {"h1": 3, "h2": 1}
    # Another generation: nothing lands, and opening it drops this one's map and holdings.
    assert pieces.land(1, host="h1", generation=1, index=0, digest=DIGESTS[0]) is None
    run_sql(db.url, "UPDATE files SET generation = 1 WHERE id = 1")
    assert _open(pieces, generation=1) is not None
    assert pieces.map(1, 0) is None and pieces.holdings(1, 0) == []


def test_at_most_k_hosts_claim_the_bucket_and_a_dead_claim_expires(db: Database) -> None:
    pieces = Pieces(db)
    assert not pieces.claim_origin(1, host="h1", generation=0, readers=1, ttl_s=10)  # no map
    _open(pieces)
    claim = {"generation": 0, "readers": 1, "ttl_s": 10.0, "now": 100.0}
    assert pieces.claim_origin(1, host="h1", **claim)  # type: ignore[arg-type]
    assert pieces.claim_origin(1, host="h1", **claim)  # type: ignore[arg-type]  # its own
    assert not pieces.claim_origin(1, host="h2", **claim)  # type: ignore[arg-type]
    two = claim | {"readers": 2}
    assert pieces.claim_origin(1, host="h2", **two)  # type: ignore[arg-type]
    assert not pieces.claim_origin(1, host="h3", **two)  # type: ignore[arg-type]
    # Claims expire unrenewed; a piece landed from the bucket renews its host's.
    pieces.land(1, host="h1", generation=0, index=0, digest=DIGESTS[0], origin_ttl_s=10, now=105)
    later = claim | {"now": 112.0}
    assert not pieces.claim_origin(1, host="h3", **later)  # type: ignore[arg-type]  # h1's
    pieces.release_origin(1, host="h1")
    assert pieces.claim_origin(1, host="h3", **later)  # type: ignore[arg-type]


def _claim_while_the_map_is_locked(db: Database, pieces: Pieces, claim: dict[str, Any]) -> bool:
    """``h2``'s claim, asked while another transaction holds the map's row lock; it must
    answer while the lock is held (a claim that queued would wait out the holder)."""
    engine = create_engine(db.url, poolclass=NullPool)
    answers: list[bool] = []
    try:
        with engine.begin() as holder:
            holder.execute(text("SELECT 1 FROM piece_maps WHERE file_id = 1 FOR UPDATE"))
            asking = threading.Thread(
                target=lambda: answers.append(pieces.claim_origin(1, host="h2", **claim))
            )
            asking.start()
            asking.join(timeout=30)
            assert not asking.is_alive() and len(answers) == 1
    finally:
        engine.dispose()
    return answers[0]


def test_a_claim_with_every_place_taken_never_waits_for_the_maps_lock(db: Database) -> None:
    """A fleet's receivers ask for the bucket at every poll; nearly all find every place taken.
    They learn it without queueing on the map's row lock (a claimer's), which another
    transaction holds here until the answer has come."""
    if not db.url.startswith("postgresql"):
        pytest.skip("SQLite takes one writer at a time anyway: the row lock is PostgreSQL's")
    pieces = Pieces(db)
    _open(pieces)
    claim = {"generation": 0, "readers": 1, "ttl_s": 10.0, "now": 100.0}
    assert pieces.claim_origin(1, host="h1", **claim)  # type: ignore[arg-type]
    assert not _claim_while_the_map_is_locked(db, pieces, claim)


def test_a_claim_never_queues_behind_another_claimer(db: Database) -> None:
    """At a rollout's start every receiver finds the bucket's places free and claims at once;
    one at a time gets the map's row lock, and the others answer False at once (they try again
    at their next poll) rather than queue behind it. With the lock free, the place is taken."""
    if not db.url.startswith("postgresql"):
        pytest.skip("SQLite takes one writer at a time anyway: the row lock is PostgreSQL's")
    pieces = Pieces(db)
    _open(pieces)
    claim = {"generation": 0, "readers": 2, "ttl_s": 10.0, "now": 100.0}
    assert not _claim_while_the_map_is_locked(db, pieces, claim)
    assert pieces.claim_origin(1, host="h2", **claim)  # type: ignore[arg-type]


def test_a_failed_fill_drops_its_unfinished_map(db: Database) -> None:
    pieces = Pieces(db)
    _open(pieces)
    pieces.land(1, host="h1", generation=0, index=0, digest=DIGESTS[0])
    pieces.land(1, host="h2", generation=0, index=0)
    pieces.drop_unfinished(1, 0)
    assert pieces.map(1, 0) is None and pieces.holdings(1, 0) == []
    _map(pieces)  # a whole map is final: never dropped so
    pieces.drop_unfinished(1, 0)
    assert pieces.map(1, 0) is not None
