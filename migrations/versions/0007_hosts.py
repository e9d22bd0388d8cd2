"""Hosts sharing a catalog: who they are and their heartbeats, and the host whose own tier
holds each file.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23

``files.host`` names the host of a file on a host-local tier (a directory); it is NULL for a
file on a shared tier (an object store), and for rows written before this revision, which an
engine on SQLite (one host) adopts at start. ``hosts.report`` is JSON the host rewrites with
each heartbeat: its tiers (name, kind, rank, whether shared) and its GPUs' leased bytes.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "hosts",
        sa.Column("host_id", sa.String(255), nullable=False),
        sa.Column("address", sa.String(1024), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("last_heartbeat", sa.Float(), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("report", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("host_id", name="pk_hosts"),
    )
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("host", sa.String(255), nullable=True))
        batch.create_index("ix_files_host", ["host"])


def downgrade() -> None:
    with op.batch_alter_table("files", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_index("ix_files_host")
        batch.drop_column("host")
    op.drop_table("hosts")
