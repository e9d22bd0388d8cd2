"""An index of the hosts holding a claim on reading a generation from the bucket (issue 42).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-29

A receiver's poll reads a window of its peers' holdings and every live claimer's
(``tiering.catalog.tracker``); without an index, finding the claimers read every host's row of
the file, the very cost the window removes. The index is partial: only rows with a claim
(``origin_until`` set; a few a file) are in it, so the holdings rewritten ten times a second
by every receiver never touch it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_CLAIMED = sa.text("origin_until IS NOT NULL")


def upgrade() -> None:
    op.create_index(
        "ix_piece_holdings_claims",
        "piece_holdings",
        ["file_id"],
        postgresql_where=_CLAIMED,
        sqlite_where=_CLAIMED,
    )


def downgrade() -> None:
    op.drop_index("ix_piece_holdings_claims", table_name="piece_holdings")
