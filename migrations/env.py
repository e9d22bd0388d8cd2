"""Alembic environment: targets tiering.catalog's metadata, on SQLite or PostgreSQL, with the
settings tierd connects with."""

from __future__ import annotations

from alembic import context
from sqlalchemy import text

from tiering.catalog.db import make_engine
from tiering.catalog.models import Base

config = context.config
target_metadata = Base.metadata

# pg_advisory_xact_lock's key for schema upgrades: hosts starting together upgrade one at a time,
# and each after the first finds the schema current.
UPGRADE_LOCK_KEY = 0x7469657264_0001  # "tierd", 1


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no catalog URL: pass it with tierd db upgrade")
    return str(url)


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(_url(), writer=True, name="tierd upgrade")
    try:
        with engine.connect() as connection:
            sqlite = connection.dialect.name == "sqlite"
            if sqlite:
                # Batch migrations rebuild tables by copy, drop and rename; with foreign keys on,
                # the drop would null every reference to the old table. Off for the migration
                # only (the pragma is a no-op inside a transaction, so it goes to the raw
                # connection first).
                raw = connection.connection.dbapi_connection
                assert raw is not None
                raw.execute("PRAGMA foreign_keys=OFF")
            context.configure(
                connection=connection, target_metadata=target_metadata, render_as_batch=True
            )
            with context.begin_transaction():
                if not sqlite:
                    # PostgreSQL runs the whole upgrade in this one transaction (DDL is
                    # transactional there); the lock is taken before Alembic reads the version,
                    # waiting as long as another host's upgrade may take. The DDL itself keeps
                    # busy_timeout as its lock_timeout: an ALTER must not queue every reader of a
                    # live fleet behind a long transaction.
                    connection.exec_driver_sql("SET LOCAL lock_timeout = '300s'")
                    connection.execute(
                        text("SELECT pg_advisory_xact_lock(:key)"), {"key": UPGRADE_LOCK_KEY}
                    )
                    connection.exec_driver_sql("SET LOCAL lock_timeout TO DEFAULT")
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
