"""Pieces of a file generation, with a digest each, and each host's verified holdings of them.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26

``piece_maps`` holds one row per file generation: the size it had, the piece size (fixed per
generation, so a later change of the default never reinterprets an old map), the digest
algorithm and every piece's digest, concatenated (``count`` x 16 bytes for xxh3_128), with
``known`` a bitmap of the digests recorded so far. The map grows as the host reading the
generation from the bucket lands its pieces (so receivers can check, and relay, pieces while
that fill runs; a piece's digest is written once, in the transaction that marks the piece
held), and is ``final`` once that host's whole-file checksum matched.

``piece_holdings`` is what one host has verified of one file generation: a bitmap of pieces
(bit ``i`` of byte ``i // 8``, lowest bit first) and how many are set, so ``locate`` shows
partial holdings during a distribution and receivers pick sources. ``origin_until`` is the
host's claim on reading the generation from the bucket (at most K live claims a generation),
renewed as its pieces land. Both cascade with the file.

``fleet_tasks.sources`` is a task's bytes by source (JSON: ``{"bucket": n, "peer:<host>": n}``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "piece_maps",
        sa.Column("file_id", sa.Integer(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("piece_size", sa.Integer(), nullable=False),
        sa.Column("algorithm", sa.String(32), nullable=False),
        sa.Column("digests", sa.LargeBinary(), nullable=False),
        sa.Column("known", sa.LargeBinary(), nullable=False),
        sa.Column("final", sa.Boolean(), nullable=False),
        sa.Column("recorded_by", sa.String(255), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["file_id"], ["files.id"], name="fk_piece_maps_file_id_files", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("file_id", "generation", name="pk_piece_maps"),
    )
    op.create_table(
        "piece_holdings",
        sa.Column("file_id", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("have", sa.LargeBinary(), nullable=False),
        sa.Column("pieces", sa.Integer(), nullable=False),
        sa.Column("origin_until", sa.Float(), nullable=True),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["file_id"], ["files.id"], name="fk_piece_holdings_file_id_files", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("file_id", "host", name="pk_piece_holdings"),
    )
    op.create_index("ix_piece_holdings_host", "piece_holdings", ["host"])
    with op.batch_alter_table("fleet_tasks") as batch:
        batch.add_column(sa.Column("sources", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("fleet_tasks") as batch:
        batch.drop_column("sources")
    op.drop_index("ix_piece_holdings_host", table_name="piece_holdings")
    op.drop_table("piece_holdings")
    op.drop_table("piece_maps")
