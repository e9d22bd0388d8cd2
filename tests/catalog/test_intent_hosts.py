"""Move intents name the host that claimed them: recovery reads its own host's, open intents of
no host (written before migration 0006) go to exactly one host, and no host's orphan cleanup
takes another's temp. On both backends."""

from __future__ import annotations

import threading

import pytest

from tests.catalog.conftest import run_sql
from tests.helpers import payload, put
from tiering.catalog import Database
from tiering.catalog.journal import Journal
from tiering.engine import Engine


def test_claim_records_the_host_and_recovery_reads_its_own(eng: Engine) -> None:
    a, b = (put(eng, f"h/{n}.bin", payload(100, n)) for n in (1, 2))
    mine = Journal(eng.catalog.db, host="host-a")
    theirs = Journal(eng.catalog.db, host="host-b")
    ia, _ = mine.claim(a.id, "ssd", reason="test")
    ib, _ = theirs.claim(b.id, "ssd", reason="test")
    assert (ia.host, ib.host) == ("host-a", "host-b")
    if eng.catalog.db.single_writer:
        # SQLite: one tierd ever writes it, so whoever recovers takes every open intent (a
        # host id that changed must not strand a crashed move).
        assert [m.id for m in mine.own_open_intents()] == [ia.id, ib.id]
        assert {m.host for m in mine.open_intents()} == {"host-a"}
    else:
        assert [m.id for m in mine.own_open_intents()] == [ia.id]
        assert [m.id for m in theirs.own_open_intents()] == [ib.id]
    # Both stay in flight for everyone: a file another host moves is busy here too.
    assert eng.catalog.busy_file_ids() == {a.id, b.id}
    assert {m.id for m in mine.open_intents()} == {ia.id, ib.id}
    # Neither temp may be cleaned as an orphan, by either host.
    assert {ia.temp_name, ib.temp_name} <= mine.kept_temp_names()
    mine.release(ia, phase="aborted", error="test")
    theirs.release(ib, phase="aborted", error="test")
    assert mine.kept_temp_names() == set()


def test_open_intents_of_no_host_go_to_exactly_one_host(eng: Engine) -> None:
    if eng.catalog.db.single_writer:
        pytest.skip("one tierd writes a SQLite catalog: it takes every open intent (see "
                    "tests/fleet/test_host_id_change.py)")  # fmt: skip
    recs = [put(eng, f"old/{n}.bin", payload(100, n)) for n in range(4)]
    first = Journal(eng.catalog.db, host="first")
    intents = [first.claim(r.id, "ssd", reason="before 0006")[0] for r in recs]
    first.release(intents[3], phase="aborted", error="closed before the upgrade")
    # As migration 0006 leaves intents written before it.
    run_sql(eng.config.catalog_url, "UPDATE migrations SET host = NULL")
    url = eng.config.catalog_url
    dbs = [Database(url) for _ in range(2)] if not eng.catalog.db.single_writer else []
    journals = [Journal(db, host=f"h{i}") for i, db in enumerate(dbs or [eng.catalog.db] * 2)]
    start = threading.Barrier(len(journals))
    adopted: list[int] = [0] * len(journals)

    def adopt(i: int) -> None:
        start.wait()
        adopted[i] = journals[i].adopt_legacy()

    threads = [threading.Thread(target=adopt, args=(i,), name=f"adopt-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert sorted(adopted) == [0, 3]
        owner = journals[adopted.index(3)]
        assert [m.id for m in owner.own_open_intents()] == [m.id for m in intents[:3]]
        other = journals[1 - adopted.index(3)]
        assert other.own_open_intents() == []
        # A closed intent keeps its NULL: history is not rewritten.
        rows = run_sql(url, "SELECT id FROM migrations WHERE host IS NULL")
        assert rows == [(intents[3].id,)]
    finally:
        for db in dbs:
            db.dispose()
