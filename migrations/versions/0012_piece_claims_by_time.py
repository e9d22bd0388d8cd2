"""The claims index keyed by the claim's end too (issue 42).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-29

0011 indexed the rows holding a claim by file alone, taking claims to be a few a file. But a
claim that runs out stays in its row until its host claims again or lets go, and a host whose
fill ended never polls again: over a rollout the index held a row for most hosts that ever
claimed, and PostgreSQL, finding the index no better than the table, read every host's row of
the file at every poll (1,000 hosts, 90% of them with a claim run out: a sequential scan of
1,000 rows in each poll's plan, measured on the H200 host with EXPLAIN ANALYZE). Keyed by
``(file_id, origin_until)``, the live claims (``origin_until > now``) are one range of it,
however many run-out ones lie before them.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_CLAIMED = sa.text("origin_until IS NOT NULL")


def _index(columns: list[str]) -> None:
    op.create_index(
        "ix_piece_holdings_claims",
        "piece_holdings",
        columns,
        postgresql_where=_CLAIMED,
        sqlite_where=_CLAIMED,
    )


def upgrade() -> None:
    op.drop_index("ix_piece_holdings_claims", table_name="piece_holdings")
    _index(["file_id", "origin_until"])


def downgrade() -> None:
    op.drop_index("ix_piece_holdings_claims", table_name="piece_holdings")
    _index(["file_id"])
