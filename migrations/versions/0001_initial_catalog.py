"""initial catalog

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("relpath", sa.String(length=4096), nullable=False),
        sa.Column("tier", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("mtime_ns", sa.BigInteger(), nullable=False),
        sa.Column("checksum", sa.String(length=64), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("access_count", sa.BigInteger(), nullable=False),
        sa.Column("heat", sa.Float(), nullable=False),
        sa.Column("heat_at", sa.Float(), nullable=False),
        sa.Column("last_access", sa.Float(), nullable=True),
        sa.Column("pinned_tier", sa.String(length=64), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
        sa.UniqueConstraint("relpath", name=op.f("uq_files_relpath")),
    )
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_files_state"), ["state"], unique=False)
        batch_op.create_index(batch_op.f("ix_files_tier"), ["tier"], unique=False)

    op.create_table(
        "policy_versions",
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("document", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("author", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("version", name=op.f("pk_policy_versions")),
    )
    op.create_table(
        "migrations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("file_id", sa.Integer(), nullable=True),
        sa.Column("relpath", sa.String(length=4096), nullable=False),
        sa.Column("src_tier", sa.String(length=64), nullable=False),
        sa.Column("dst_tier", sa.String(length=64), nullable=False),
        sa.Column("temp_name", sa.String(length=255), nullable=False),
        sa.Column("phase", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("bytes_copied", sa.BigInteger(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["file_id"], ["files.id"], name=op.f("fk_migrations_file_id_files"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_migrations")),
    )
    with op.batch_alter_table("migrations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_migrations_file_id"), ["file_id"], unique=False)
        batch_op.create_index("ix_migrations_phase", ["phase"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("migrations", schema=None) as batch_op:
        batch_op.drop_index("ix_migrations_phase")
        batch_op.drop_index(batch_op.f("ix_migrations_file_id"))

    op.drop_table("migrations")
    op.drop_table("policy_versions")
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_files_tier"))
        batch_op.drop_index(batch_op.f("ix_files_state"))

    op.drop_table("files")
