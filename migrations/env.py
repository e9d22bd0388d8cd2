"""Alembic environment: targets tiering.catalog's metadata with tierd's SQLite settings."""

from __future__ import annotations

from alembic import context

from tiering.catalog.db import make_engine
from tiering.catalog.models import Base

config = context.config
target_metadata = Base.metadata


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
    engine = make_engine(_url(), writer=True)
    try:
        with engine.connect() as connection:
            # Batch migrations rebuild tables by copy, drop and rename; with foreign keys on, the
            # drop would null every reference to the old table. Off for the migration only (the
            # pragma is a no-op inside a transaction, so it goes to the raw connection first).
            raw = connection.connection.dbapi_connection
            assert raw is not None
            raw.execute("PRAGMA foreign_keys=OFF")
            context.configure(
                connection=connection, target_metadata=target_metadata, render_as_batch=True
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
