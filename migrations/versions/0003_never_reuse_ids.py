"""Never reuse file or migration ids (SQLite AUTOINCREMENT).

PostgreSQL needs nothing here: its ``serial`` ids come from sequences, which never hand out a
number twice (0001 created them).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _sqlite() -> bool:
    return bool(op.get_bind().dialect.name == "sqlite")


def upgrade() -> None:
    if not _sqlite():
        return
    for table in ("files", "migrations"):
        with op.batch_alter_table(
            table, recreate="always", table_kwargs={"sqlite_autoincrement": True}
        ):
            pass


def downgrade() -> None:
    if not _sqlite():
        return
    for table in ("files", "migrations"):
        with op.batch_alter_table(
            table, recreate="always", table_kwargs={"sqlite_autoincrement": False}
        ):
            pass
