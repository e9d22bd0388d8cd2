"""The Alembic migrations build exactly the schema the models describe, the same one on SQLite
and on PostgreSQL, run on old data, and never hand out an id twice."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.pool import NullPool

from tests.catalog.conftest import run_sql
from tiering.catalog.db import make_engine, migrations_dir, upgrade
from tiering.catalog.models import Base

_FILE = (
    "INSERT INTO files (relpath, tier, size, mtime_ns, state, generation, access_count,"
    " heat, heat_at, created_at, updated_at) VALUES (:p, 'nvme', 1, 1, 'stable', 0, 0,"
    " 0, 0, 0, 0)"
)


def test_models_match_migrations(empty_catalog_url: str) -> None:
    upgrade(empty_catalog_url)
    engine = make_engine(empty_catalog_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []


def test_upgrade_keeps_data_and_never_reuses_ids(empty_catalog_url: str) -> None:
    url = empty_catalog_url
    upgrade(url, "0002")
    run_sql(url, _FILE, {"p": "a"})
    run_sql(
        url,
        "INSERT INTO migrations (file_id, relpath, src_tier, dst_tier, temp_name, phase, size,"
        " bytes_copied, generation, started_at) VALUES (1, 'a', 'nvme', 'ssd', 't', 'done',"
        " 1, 1, 0, 0)",
    )
    upgrade(url)
    upgrade(url)  # a second run is a no-op
    assert run_sql(url, "SELECT file_id FROM migrations") == [(1,)]
    run_sql(url, "DELETE FROM migrations")
    run_sql(url, "DELETE FROM files")
    run_sql(url, _FILE, {"p": "b"})
    assert run_sql(url, "SELECT id FROM files") == [(2,)]


def _type(t: Any) -> tuple[str, int | None]:
    # The generic kind of a reflected type: SQLite says FLOAT where PostgreSQL says DOUBLE
    # PRECISION for the same Float column, and both are 8-byte floats; BLOB and BYTEA are the
    # same LargeBinary.
    for kind in (
        sa.BigInteger,
        sa.Integer,
        sa.Float,
        sa.Text,
        sa.String,
        sa.LargeBinary,
        sa.Boolean,
    ):
        if isinstance(t, kind):
            return kind.__name__, getattr(t, "length", None)
    raise AssertionError(f"unexpected column type {t!r}")


def _schema(url: str) -> dict[str, Any]:
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        insp = sa.inspect(engine)
        out: dict[str, Any] = {}
        for table in sorted(insp.get_table_names()):
            out[table] = {
                "columns": {
                    c["name"]: (_type(c["type"]), c["nullable"]) for c in insp.get_columns(table)
                },
                "primary_key": insp.get_pk_constraint(table)["constrained_columns"],
                "unique": sorted(
                    (u["name"], tuple(u["column_names"]))
                    for u in insp.get_unique_constraints(table)
                ),
                "indexes": sorted(
                    (i["name"], tuple(i["column_names"]), bool(i["unique"]))
                    for i in insp.get_indexes(table)
                    if not i.get("duplicates_constraint")  # PostgreSQL's index of a UNIQUE
                ),
                "foreign_keys": sorted(
                    (
                        tuple(f["constrained_columns"]),
                        f["referred_table"],
                        tuple(f["referred_columns"]),
                        (f.get("options") or {}).get("ondelete"),
                    )
                    for f in insp.get_foreign_keys(table)
                ),
            }
        return out
    finally:
        engine.dispose()


def test_both_backends_get_the_same_tables_and_columns(tmp_path: Path, pg_empty_url: str) -> None:
    sqlite_url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade(sqlite_url)
    upgrade(pg_empty_url)
    on_sqlite, on_postgresql = _schema(sqlite_url), _schema(pg_empty_url)
    assert set(on_sqlite) == {
        "alembic_version",
        "copies",
        "files",
        "fleet_jobs",
        "fleet_tasks",
        "host_heat",
        "hosts",
        "migrations",
        "piece_holdings",
        "piece_maps",
        "policy_versions",
    }
    assert on_postgresql == on_sqlite


def test_hosts_upgrading_at_once_upgrade_once(pg_empty_url: str) -> None:
    # Several hosts start together on an empty PostgreSQL catalog: one creates the schema, the
    # others wait for it and find it current. Processes, as hosts are (Alembic's context is
    # one per process).
    code = "import sys; from tiering.catalog.db import upgrade; upgrade(sys.argv[1])"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, pg_empty_url],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    head = ScriptDirectory(str(migrations_dir())).get_current_head()
    assert run_sql(pg_empty_url, "SELECT version_num FROM alembic_version") == [(head,)]
    assert len(run_sql(pg_empty_url, "SELECT 1 FROM pg_tables WHERE tablename = 'files'")) == 1


def test_the_poll_function_comes_and_goes_with_its_migration(pg_empty_url: str) -> None:
    """0013's ``tierd_poll`` on PostgreSQL: made by the upgrade, dropped by the downgrade,
    made again; and the poll through it answers (a window of one host)."""
    from alembic import command
    from alembic.config import Config

    from tiering.catalog.db import Database
    from tiering.catalog.pieces import Pieces

    def functions() -> list[Any]:
        return run_sql(pg_empty_url, "SELECT proname FROM pg_proc WHERE proname = 'tierd_poll'")

    upgrade(pg_empty_url)
    assert len(functions()) == 1
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["url"] = pg_empty_url
    command.downgrade(cfg, "0012")
    assert functions() == []
    upgrade(pg_empty_url)
    assert len(functions()) == 1
    run_sql(pg_empty_url, _FILE, {"p": "a"})
    db = Database(pg_empty_url)
    try:
        pieces = Pieces(db)
        m = pieces.open_map(1, generation=0, size=2, piece_size=1, algorithm="xxh3_128", host="h1")
        assert m is not None
        pieces.tell(1, host="h2", generation=0, have=b"\x01")
        ex = pieces.exchange(1, host="h1", generation=0, have=b"\x02", after="")
        assert ex is not None and [h.host for h in ex.holdings] == ["h2"]
        assert [(h.host, h.pieces) for h in pieces.holdings(1, 0)] == [("h1", 1), ("h2", 1)]
    finally:
        db.dispose()
