"""Cached copies of files (memory tiers now; GPU and other hosts later) in their own table.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "copies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("file_id", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("location", sa.String(64), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["file_id"], ["files.id"], name="fk_copies_file_id_files", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_copies"),
        sa.UniqueConstraint("file_id", "host", "location", name="uq_copies_file_id"),
    )
    op.create_index("ix_copies_file_id", "copies", ["file_id"])


def downgrade() -> None:
    # Copies are caches: dropping the table loses nothing a restart would not.
    op.drop_index("ix_copies_file_id", table_name="copies")
    op.drop_table("copies")
