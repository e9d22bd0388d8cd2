"""The catalog's table of cached copies: migration 0005 up and down on real data, and the
rules of its rows (written only for the generation copied, gone with their file, forgotten
per host at start). On SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy.exc
from alembic import command
from alembic.config import Config

from tests.catalog.conftest import run_sql
from tiering.catalog import Copies, Database
from tiering.catalog.db import migrations_dir, upgrade

_FILE = (
    "INSERT INTO files (relpath, tier, size, mtime_ns, state, generation, access_count, heat,"
    " heat_at, created_at, updated_at) VALUES (:p, 'nvme', 10, 1, :s, :g, 0, 0, 0, 0, 0)"
)


def _downgrade(url: str, revision: str) -> None:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["url"] = url
    command.downgrade(cfg, revision)


def _tables(url: str) -> set[str]:
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    try:
        return set(sqlalchemy.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_0005_upgrades_and_downgrades_keeping_the_files(empty_catalog_url: str) -> None:
    url = empty_catalog_url
    upgrade(url, "0004")
    run_sql(url, _FILE, {"p": "a", "s": "stable", "g": 3})
    upgrade(url)
    assert "copies" in _tables(url)
    db = Database(url)
    copies = Copies(db)
    assert copies.record(1, host="h", location="ram", generation=3, size=10, states=["stable"])
    assert [(r.file_id, r.host, r.location, r.generation) for r in copies.list()] == [
        (1, "h", "ram", 3)
    ]
    db.dispose()
    _downgrade(url, "0004")
    assert "copies" not in _tables(url)
    assert run_sql(url, "SELECT relpath, generation FROM files") == [("a", 3)]
    upgrade(url)
    upgrade(url)  # a second run is a no-op
    db = Database(url)
    assert Copies(db).list() == []  # a cache: nothing to keep across the downgrade
    db.dispose()


@pytest.fixture
def db(empty_catalog_url: str) -> Iterator[Database]:
    url = empty_catalog_url
    upgrade(url)
    for path, state in (("a", "stable"), ("b", "migrating"), ("c", "missing")):
        run_sql(url, _FILE, {"p": path, "s": state, "g": 0})
    database = Database(url)
    yield database
    database.dispose()


def test_a_row_is_written_only_for_the_generation_and_state_copied(db: Database) -> None:
    copies = Copies(db)
    ok = ("stable", "migrating")
    assert not copies.record(1, host="h", location="ram", generation=1, size=10, states=ok)
    assert not copies.record(3, host="h", location="ram", generation=0, size=10, states=ok)
    assert not copies.record(99, host="h", location="ram", generation=0, size=10, states=ok)
    assert copies.list() == []
    assert copies.record(1, host="h", location="ram", generation=0, size=10, states=ok)
    assert copies.record(1, host="h", location="ram", generation=0, size=10, states=ok)  # again
    assert len(copies.list(file_id=1)) == 1  # replaced, never doubled


def test_rows_go_with_their_file_and_per_host_at_start(db: Database) -> None:
    copies = Copies(db)
    ok = ("stable", "migrating")
    for host, loc in [("h", "ram"), ("h", "cuda:0"), ("h", "nvme"), ("g", "ram")]:
        assert copies.record(1, host=host, location=loc, generation=0, size=10, states=ok)
    assert copies.record(2, host="h", location="ram", generation=0, size=10, states=ok)
    with pytest.raises(sqlalchemy.exc.IntegrityError), db.write() as s:
        # One row per file, host and location.
        s.execute(
            sqlalchemy.text(
                "INSERT INTO copies (file_id, host, location, generation, size, created_at)"
                " VALUES (1, 'g', 'ram', 0, 1, 0)"
            )
        )
    assert copies.forget_host("h", keep=["nvme"]) == 3
    assert sorted((r.file_id, r.host, r.location) for r in copies.list()) == [
        (1, "g", "ram"),
        (1, "h", "nvme"),
    ]
    assert copies.forget_host("h", keep=["nvme"]) == 0  # twice: nothing more
    with db.write() as s:
        s.execute(sqlalchemy.text("DELETE FROM files WHERE id = 1"))
    assert copies.list() == []  # ON DELETE CASCADE
