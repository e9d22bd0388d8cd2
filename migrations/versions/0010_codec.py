"""How a tier stores a file: its codec and stored size (issue 29, compressed tiers).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26

``files.codec`` names tierd's compressed format (``tierdz1``) where a tier stores the file
compressed, and ``files.stored_size`` the bytes it takes there; both NULL for a file stored as
it is. ``size`` and ``checksum`` stay those of the logical bytes, what readers get.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("codec", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("stored_size", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.drop_column("stored_size")
        batch.drop_column("codec")
