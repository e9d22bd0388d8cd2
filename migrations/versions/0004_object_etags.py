"""Record each file's object-store version (ETag) where its tier has one.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("etag", sa.String(256), nullable=True))


def downgrade() -> None:
    # Dropping a column recreates the table on SQLite: keep its AUTOINCREMENT (0003).
    with op.batch_alter_table("files", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_column("etag")
