"""Migration 0010 (a file's codec and stored size) up and down on real data, on SQLite and
PostgreSQL; the repository records them and counts stored bytes per tier."""

from __future__ import annotations

from tests.catalog.conftest import run_sql
from tests.catalog.test_copies import _FILE, _downgrade
from tiering.catalog import Catalog, NewFile
from tiering.catalog.db import Database, upgrade


def test_0010_upgrades_and_downgrades_keeping_the_files(empty_catalog_url: str) -> None:
    url = empty_catalog_url
    upgrade(url, "0009")
    run_sql(url, _FILE, {"p": "a", "s": "stable", "g": 4})
    upgrade(url)
    assert run_sql(url, "SELECT relpath, codec, stored_size FROM files") == [("a", None, None)]
    _downgrade(url, "0009")
    assert run_sql(url, "SELECT relpath, generation FROM files") == [("a", 4)]
    upgrade(url)


def test_codec_and_stored_size_are_recorded_and_counted(empty_catalog_url: str) -> None:
    upgrade(empty_catalog_url)
    db = Database(empty_catalog_url)
    try:
        cat = Catalog(db)
        cat.upsert(NewFile("m.safetensors", "hdd", 1000, 1, "c1", None, "tierdz1", 690))
        cat.upsert(NewFile("raw.bin", "hdd", 500, 1, "c2"))
        rec = cat.lookup("m.safetensors")
        assert (rec.codec, rec.stored_size) == ("tierdz1", 690)
        usage = cat.usage()["hdd"]
        assert (usage.files, usage.bytes, usage.stored) == (2, 1500, 1190)
        # Rewritten as it is: the codec goes.
        cat.upsert(NewFile("m.safetensors", "hdd", 1000, 2, "c3"))
        rec = cat.lookup("m.safetensors")
        assert (rec.codec, rec.stored_size) == (None, None)
        assert cat.usage()["hdd"].stored == 1500
    finally:
        db.dispose()
