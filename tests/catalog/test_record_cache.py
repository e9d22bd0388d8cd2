"""The read path's cache of file records: a move changes one record, so it keeps every other
record cached, and never lets its own file's record be read stale.

A record answered from the cache is the very object cached before (``is``); one read again
from SQLite is a new object. The engine and its catalog are real (Alembic, SQLite, temp tiers).

The cache is SQLite's: there tierd is the catalog's only writer. On PostgreSQL other hosts write
the same records, so every read asks the database (the last test).
"""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select

from tests.helpers import put
from tiering.catalog import Database, FileRecord
from tiering.catalog.journal import Journal
from tiering.engine import Engine
from tiering.errors import FileNotFound

sqlite_only = pytest.mark.parametrize("catalog_backend", ["sqlite"])


@sqlite_only
def test_a_move_keeps_other_records_cached_and_its_own_current(eng: Engine) -> None:
    moving, other = put(eng, "a.bin", b"aaaa"), put(eng, "b.bin", b"bbbb")
    cat = eng.catalog
    before = cat.get(other.id, cached=True)
    assert cat.get(other.id, cached=True) is before  # cached
    seen = cat.get(moving.id, cached=True)
    assert seen.tier == "nvme"
    eng.migrate(moving.id, "ssd")
    assert cat.get(other.id, cached=True) is before  # the move named its file only
    after = cat.get(moving.id, cached=True)
    assert after is not seen and after.tier == "ssd" and after.generation == seen.generation + 1
    assert cat.lookup("a.bin", cached=True).tier == "ssd"
    # A write that does not name its files (an upload) still invalidates every record.
    put(eng, "c.bin", b"c")
    assert cat.get(other.id, cached=True) is not before


@sqlite_only
def test_a_record_read_during_a_write_of_its_file_is_not_kept(eng: Engine) -> None:
    rec = put(eng, "a.bin", b"aaaa")
    cat, db = eng.catalog, eng.catalog.db
    with db.write(files=(rec.id,)) as s:
        row = s.get(FileRecord, rec.id)
        assert row is not None
        row.tier = "ssd"
        s.flush()
        # Read from another connection while the write is open: the old row, not kept.
        got: list[FileRecord] = []
        reader = threading.Thread(target=lambda: got.append(cat.get(rec.id, cached=True)))
        reader.start()
        reader.join()
        assert got[0].tier == "nvme"
    assert cat.get(rec.id, cached=True).tier == "ssd"


@sqlite_only
def test_a_record_read_before_a_write_of_its_file_is_not_served_after(eng: Engine) -> None:
    rec = put(eng, "a.bin", b"aaaa")
    cat, db = eng.catalog, eng.catalog.db
    stamp = db.stamp(rec.id)
    with db.read() as s:
        old = s.get(FileRecord, rec.id)  # read...
    assert old is not None
    with db.write(files=(rec.id,)) as s:  # ...a write commits...
        row = s.get(FileRecord, rec.id)
        assert row is not None
        row.tier = "ssd"
    cat._cache_put(rec.id, old, stamp)  # ...and the reader keeps what it read, stamped before
    assert cat.get(rec.id, cached=True).tier == "ssd"


@sqlite_only
def test_counters_restart_past_their_bound_without_serving_stale_records(eng: Engine) -> None:
    recs = [put(eng, f"f{i}.bin", b"x") for i in range(4)]
    cat, db = eng.catalog, eng.catalog.db
    db.FILE_GENERATIONS_MAX = 2
    cached = [cat.get(r.id, cached=True) for r in recs]
    for r in recs:
        with db.write(files=(r.id,)) as s:
            row = s.get(FileRecord, r.id)
            assert row is not None
            row.tier = "ssd"
    assert len(db._file_generations) <= 2
    for r, old in zip(recs, cached, strict=True):
        now = cat.get(r.id, cached=True)
        assert now is not old and now.tier == "ssd"


def test_relpaths_follow_renames_and_deletes(eng: Engine) -> None:
    rec = put(eng, "old.bin", b"o")
    cat = eng.catalog
    assert cat.lookup("old.bin", cached=True).id == rec.id
    assert cat.rename("old.bin", "new.bin", "nvme") is not None
    with pytest.raises(FileNotFound):
        cat.lookup("old.bin", cached=True)
    assert cat.lookup("new.bin", cached=True).id == rec.id
    eng.delete(rec.id)
    with pytest.raises(FileNotFound):
        cat.lookup("new.bin", cached=True)
    with eng.catalog.db.read() as s:
        assert s.scalar(select(FileRecord).where(FileRecord.relpath == "new.bin")) is None


@pytest.mark.parametrize("catalog_backend", ["postgresql"])
def test_records_another_host_changed_are_never_served_stale(eng: Engine) -> None:
    rec = put(eng, "a.bin", b"aaaa")
    cat = eng.catalog
    assert not cat.db.caches_records
    first = cat.get(rec.id, cached=True)
    assert cat.lookup("a.bin", cached=True).id == rec.id
    other_host = Database(eng.config.catalog_url)  # another tierd's connections
    try:
        intent, _ = Journal(other_host).claim(rec.id, "ssd", reason="test")
        assert cat.get(rec.id, cached=True).state == "migrating"
        Journal(other_host).release(intent, phase="aborted", error="test")
        with other_host.write() as s:
            row = s.get(FileRecord, rec.id)
            assert row is not None
            row.relpath, row.generation = "b.bin", row.generation + 1
    finally:
        other_host.dispose()
    now = cat.get(rec.id, cached=True)
    assert now is not first and (now.relpath, now.generation) == ("b.bin", rec.generation + 1)
    with pytest.raises(FileNotFound):
        cat.lookup("a.bin", cached=True)
    assert cat.lookup("b.bin", cached=True).id == rec.id
