"""The tracker's hot path (issue 42): a receiver's poll writes its whole holding in one
statement and reads a window of its peers' holdings, walking the fleet round, plus every live
claimer's, with their addresses and heartbeats; a fill's PeerWindow batches what it tells. On
SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.catalog.conftest import run_sql
from tests.catalog.test_copies import _FILE
from tiering.catalog.db import Database, upgrade
from tiering.catalog.pieces import Pieces, bitmap, bits_of
from tiering.fleet.peerwindow import PeerWindow
from tiering.fleet.pieces import ALGORITHM, PIECE_SIZE

COUNT = 10
HOSTS = ["h1", "h2", "h3", "h4", "h5"]
_HOST = (
    "INSERT INTO hosts (host_id, address, started_at, last_heartbeat, version, report) "
    "VALUES (:h, :a, 0, :t, 'v', '{}')"
)


@pytest.fixture
def db(empty_catalog_url: str) -> Iterator[Database]:
    upgrade(empty_catalog_url)
    run_sql(empty_catalog_url, _FILE, {"p": "a", "s": "stable", "g": 0})
    for i, h in enumerate(HOSTS):
        run_sql(empty_catalog_url, _HOST, {"h": h, "a": f"http://{h}", "t": 100.0 + i})
    database = Database(empty_catalog_url)
    Pieces(database).open_map(
        1, generation=0, size=COUNT * PIECE_SIZE, piece_size=PIECE_SIZE, algorithm=ALGORITHM,
        host="h1",
    )  # fmt: skip
    yield database
    database.dispose()


def _hosts(pieces: Pieces, me: str, after: str, limit: int, now: float = 0.0) -> list[str]:
    ex = pieces.exchange(1, host=me, generation=0, after=after, limit=limit, now=now)
    assert ex is not None
    return [h.host for h in ex.holdings]


def test_a_poll_reads_a_window_walking_the_fleet_round(db: Database) -> None:
    pieces = Pieces(db)
    for i, h in enumerate(HOSTS):
        assert pieces.tell(1, host=h, generation=0, have=bitmap([i], COUNT))
    # From after the cursor, in host order, never this host's own row; round the end.
    assert _hosts(pieces, "h1", "h1", 2) == ["h2", "h3"]
    assert _hosts(pieces, "h1", "h3", 2) == ["h4", "h5"]
    assert _hosts(pieces, "h1", "h5", 2) == ["h2", "h3"]
    assert _hosts(pieces, "h3", "h4", 3) == ["h5", "h1", "h2"]
    ex = pieces.exchange(1, host="h1", generation=0, after="h4", limit=3)
    assert ex is not None and ex.after == "h3"  # the next poll starts after the last read
    # Every holding comes with its host's address and heartbeat, and its bits.
    h5 = next(h for h in ex.holdings if h.host == "h5")
    assert (h5.address, h5.heartbeat, h5.pieces, bits_of(h5.have, COUNT)) == (
        "http://h5", 104.0, 1, [4],
    )  # fmt: skip
    # A fleet within the window is read whole at each poll.
    assert sorted(_hosts(pieces, "h1", "h1", 32)) == ["h2", "h3", "h4", "h5"]
    assert pieces.exchange(1, host="h1", generation=1, after="h1") == type(ex)([], "h1")


def test_a_live_claimer_is_in_every_window(db: Database) -> None:
    pieces = Pieces(db)
    for h in HOSTS:
        pieces.tell(1, host=h, generation=0, have=bitmap([], COUNT))
    assert pieces.claim_origin(1, host="h5", generation=0, readers=1, ttl_s=10.0, now=50.0)
    assert _hosts(pieces, "h1", "h1", 2, now=55.0) == ["h2", "h3", "h5"]
    assert _hosts(pieces, "h1", "h3", 2, now=55.0) == ["h4", "h5"]  # read once
    assert _hosts(pieces, "h1", "h1", 2, now=61.0) == ["h2", "h3"]  # the claim expired


def test_a_poll_writes_the_whole_holding_and_keeps_the_claim(db: Database) -> None:
    pieces = Pieces(db)
    assert pieces.claim_origin(1, host="h2", generation=0, readers=1, ttl_s=10.0, now=50.0)
    ex = pieces.exchange(1, host="h2", generation=0, have=bitmap([0, 3], COUNT), now=51.0)
    assert ex is not None
    h = pieces.holding(1, "h2")
    assert h is not None and (bits_of(h.have, COUNT), h.pieces, h.origin_until) == ([0, 3], 2, 60)
    pieces.tell(1, host="h2", generation=0, have=bitmap([0, 3, 9], COUNT))
    h = pieces.holding(1, "h2")
    assert h is not None and h.pieces == 3 and h.origin_until == 60
    # Another generation than the file's: refused, nothing written.
    run_sql(db.url, "UPDATE files SET generation = 1 WHERE id = 1")
    assert pieces.exchange(1, host="h3", generation=0, have=bitmap([1], COUNT)) is None
    assert not pieces.tell(1, host="h3", generation=0, have=bitmap([1], COUNT))
    assert pieces.holding(1, "h3") is None


def test_a_window_tells_what_landed_once_and_keeps_wide_finds_in_view(db: Database) -> None:
    pieces = Pieces(db)
    pieces.tell(1, host="h5", generation=0, have=bitmap(range(COUNT), COUNT))
    w = PeerWindow(pieces, 1, 0, "h1", count=COUNT, window=2)
    assert w.waiting_s() == 0.0 and w.flush()  # nothing to tell: nothing written
    assert pieces.holding(1, "h1") is None
    w.landed([1])
    w.landed([2])
    assert w.waiting_s() > 0.0
    polled = w.poll()
    assert polled is not None and [h.host for h in polled] == ["h5"]
    h = pieces.holding(1, "h1")
    assert h is not None and bits_of(h.have, COUNT) == [1, 2] and w.waiting_s() == 0.0
    stamp = h.updated_at
    assert w.poll() is not None  # nothing new: a read only
    h = pieces.holding(1, "h1")
    assert h is not None and h.updated_at == stamp
    # A wide read keeps in view the holders of pieces this host lacks, polls or not.
    for other in ("h2", "h3", "h4"):
        pieces.tell(1, host=other, generation=0, have=bitmap([1], COUNT))
    assert w.refresh(10.0, wide=True, lacked=lambda: set(range(3, COUNT)))
    assert [h.host for h in w.view()] == ["h5"] and w.wide_at == 10.0
    assert w.refresh(10.1, wide=False, lacked=set)
    assert sorted(h.host for h in w.view()) == ["h2", "h3", "h5"]  # round to the start


def test_a_window_polls_less_often_as_it_finds_more_hosts_filling(db: Database) -> None:
    """The fleet's polls are held to a budget (issue 42: 1,000 hosts polling ten times a second
    asked one PostgreSQL for 10,000 polls a second): each host's interval is the hosts it has
    seen still filling over the budget, never under POLL_S; hosts that finished poll no more
    and stop counting."""
    from tiering.fleet.peerwindow import POLL_S

    pieces = Pieces(db)
    for h in ("h2", "h3", "h4"):
        pieces.tell(1, host=h, generation=0, have=bitmap([0], COUNT))
    pieces.tell(1, host="h5", generation=0, have=bitmap(range(COUNT), COUNT))  # a seed
    w = PeerWindow(pieces, 1, 0, "h1", count=COUNT, window=2, polls_per_s=20.0)
    assert w.interval == POLL_S  # only itself seen: 1 / 20 s is under POLL_S
    assert w.poll() is not None  # h2, h3
    assert w.interval == pytest.approx(3 / 20)
    assert w.poll() is not None  # h4, h5: the seed does not count
    assert w.interval == pytest.approx(4 / 20)
    pieces.tell(1, host="h2", generation=0, have=bitmap(range(COUNT), COUNT))
    assert [h.host for h in w.leaders()] == ["h2", "h5", "h3", "h4"]  # most complete first
    assert w.interval == pytest.approx(3 / 20)  # h2 is done: h1, h3, h4 fill
    # A wide read counts every host still filling, those past its rows too.
    for i in range(20):
        pieces.tell(1, host=f"x{i:02d}", generation=0, have=bitmap([1], COUNT))
    assert len(w.leaders()) == 4 * 2  # four windows' worth of rows
    assert w.interval == pytest.approx(22 / 20)  # h3, h4 and x00-x19 (h1's own row: none)
    # Hosts finish; once the windows have walked the fleet round, the census is dropped and
    # the hosts they saw still filling are the count.
    for i in range(20):
        pieces.tell(1, host=f"x{i:02d}", generation=0, have=bitmap(range(COUNT), COUNT))
    for _ in range(20):
        assert w.poll() is not None
    assert w.interval == pytest.approx(3 / 20)  # h1, h3, h4
    assert PeerWindow(pieces, 1, 0, "h1", count=COUNT).interval == POLL_S  # the default budget
    with pytest.raises(ValueError, match="polls_per_s"):
        PeerWindow(pieces, 1, 0, "h1", polls_per_s=0)
