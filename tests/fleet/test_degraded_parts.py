"""The parts of the degraded mode, on a real PostgreSQL catalog whose server the test stops: the
catalog's fallback to the last known records (and never in place of a live read), the access
counts kept and bounded meanwhile, and the scheduler's pause."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tests.pg_support import PausablePg
from tiering.catalog import Catalog, Database, FileRecord, NewFile
from tiering.catalog.known import LastKnown
from tiering.errors import CatalogUnreachable
from tiering.placement.access import AccessTracker


@pytest.fixture
def pg(private_pg: PausablePg) -> PausablePg:
    return private_pg  # a server of the test's own, from the session's migrated cluster


@pytest.fixture
def catalog(pg: PausablePg) -> Iterator[Catalog]:
    db = Database(pg.url(pg.create_database()), host="host-a", shared_tiers=["s3"])
    try:
        yield Catalog(db)
    finally:
        db.dispose()


def _new(rel: str, tier: str = "nvme", size: int = 10) -> NewFile:
    return NewFile(rel, tier, size, 1, "c" * 64)


def test_the_fallback_answers_only_while_the_database_is_down(
    catalog: Catalog, pg: PausablePg, caplog: pytest.LogCaptureFixture
) -> None:
    a, shared, unread = (
        catalog.upsert(_new(r, t)) for r, t in (("a", "nvme"), ("s", "s3"), ("u", "nvme"))
    )
    assert a is not None and shared is not None and unread is not None
    assert catalog.get(a.id).id == a.id and catalog.lookup("s").id == shared.id
    # Another host's file is read too, but its bytes are on that host's disks: not kept.
    pg.execute(
        catalog.db.url.rsplit("/", 1)[1], "UPDATE files SET host = 'host-b' WHERE relpath = 'u'"
    )
    assert catalog.get(unread.id).host == "host-b"
    # A newer record from the database replaces the kept one (here: the size changed).
    catalog.upsert(_new("a", size=20))
    assert catalog.lookup("a", cached=True).size == 20

    pg.halt()
    with caplog.at_level(logging.WARNING, logger="tiering.catalog.db"):
        assert catalog.get(a.id, cached=True).size == 20
        assert catalog.lookup("a", cached=True).id == a.id
        assert catalog.get(shared.id, cached=True).tier == "s3"
        for _ in range(3):  # logged once per outage, not once per failed call
            with pytest.raises(CatalogUnreachable):
                catalog.get(a.id)  # not the read path: no fallback
        with pytest.raises(CatalogUnreachable):
            catalog.get(unread.id, cached=True)
        with pytest.raises(CatalogUnreachable):
            catalog.upsert(_new("new"))
    assert catalog.db.outage is not None and "cannot be reached" in catalog.db.outage.reason
    assert len([r for r in caplog.records if "cannot be reached" in r.getMessage()]) == 1

    pg.resume()
    # Back: the database answers again, and its answer wins over the kept record.
    pg.execute(catalog.db.url.rsplit("/", 1)[1], "UPDATE files SET size = 30 WHERE relpath = 'a'")
    assert catalog.get(a.id, cached=True).size == 30
    assert catalog.db.outage is None
    assert catalog.find("new") is None  # the write that failed left nothing


def test_last_known_is_bounded_and_keeps_the_newest() -> None:
    known = LastKnown("h", max_records=2)

    def rec(
        fid: int, rel: str, gen: int, host: str | None = "h", state: str = "stable"
    ) -> FileRecord:
        return FileRecord(id=fid, relpath=rel, generation=gen, host=host, state=state, tier="t")

    known.keep(rec(1, "a", 2))
    known.keep(rec(1, "a", 1))  # an older read arriving late is ignored
    assert known.by_id(1) is not None and known.by_id(1).generation == 2  # type: ignore[union-attr]
    known.keep(rec(1, "a2", 3))  # renamed: the old path no longer names it
    assert known.by_path("a") is None and known.by_path("a2") is not None
    known.keep(rec(2, "b", 0))
    known.keep(rec(3, "c", 0))  # past the bound, the least recently read goes
    assert known.by_id(1) is None and known.by_path("a2") is None and len(known) == 2
    known.keep(rec(2, "b", 1, state="migrating"))  # no longer a stable record: dropped
    assert known.by_path("b") is None
    known.keep(rec(4, "d", 0, host="other"))
    assert known.by_id(4) is None
    known.read_path("c", None)  # the database says there is none
    assert known.by_id(3) is None


def test_access_counts_wait_for_the_catalog_bounded(catalog: Catalog, pg: PausablePg) -> None:
    recs = [catalog.upsert(_new(f"f{i}")) for i in range(3)]
    ids = [r.id for r in recs if r is not None]
    tracker = AccessTracker(catalog, half_life_s=3600, interval_s=3600)
    tracker.max_files = 2
    pg.halt()
    tracker.record(ids[0], 5)
    tracker.record(ids[1], 3)
    tracker.record(ids[2], 1)
    with pytest.raises(CatalogUnreachable):
        tracker.flush()
    # The least accessed file's count was dropped to keep the bound; the others wait.
    assert tracker.pending() == 8 and tracker.dropped == 1
    tracker.record(ids[0])
    pg.resume()
    assert tracker.flush() == 2
    assert [catalog.get(i).access_count for i in ids] == [6, 3, 0]
    assert tracker.pending() == 0
