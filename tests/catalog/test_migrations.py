"""The Alembic migrations build exactly the schema the models describe, and run on old data."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from tiering.catalog.db import make_engine, upgrade
from tiering.catalog.models import Base


def test_models_match_migrations(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade(url)
    engine = make_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []


def test_upgrade_keeps_data_and_never_reuses_ids(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade(url, "0002")
    with sqlite3.connect(tmp_path / "c.db") as db:
        db.execute(
            "INSERT INTO files (relpath, tier, size, mtime_ns, state, generation, access_count,"
            " heat, heat_at, created_at, updated_at) VALUES ('a', 'nvme', 1, 1, 'stable', 0, 0,"
            " 0, 0, 0, 0)"
        )
        db.execute(
            "INSERT INTO migrations (file_id, relpath, src_tier, dst_tier, temp_name, phase, size,"
            " bytes_copied, generation, started_at) VALUES (1, 'a', 'nvme', 'ssd', 't', 'done',"
            " 1, 1, 0, 0)"
        )
    upgrade(url)
    upgrade(url)  # a second run is a no-op
    with sqlite3.connect(tmp_path / "c.db") as db:
        assert db.execute("SELECT file_id FROM migrations").fetchall() == [(1,)]
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("DELETE FROM migrations")
        db.execute("DELETE FROM files")
        db.execute(
            "INSERT INTO files (relpath, tier, size, mtime_ns, state, generation, access_count,"
            " heat, heat_at, created_at, updated_at) VALUES ('b', 'nvme', 1, 1, 'stable', 0, 0,"
            " 0, 0, 0, 0)"
        )
        assert db.execute("SELECT id FROM files").fetchall() == [(2,)]
