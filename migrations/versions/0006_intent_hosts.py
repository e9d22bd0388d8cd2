"""Each move intent names the host whose mover claimed it: recovery settles its own host's.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23

Intents written before this revision get NULL, which means "a host from before fleets". The
migration cannot know which host id the tierd that wrote them runs under (the setting is not
in the catalog), and before this revision only one tierd ever wrote a catalog. The first host
whose recovery runs adopts such an open intent, in one compare-and-set (see
``Journal.adopt_legacy``), so exactly one host settles it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("migrations") as batch:
        batch.add_column(sa.Column("host", sa.String(255), nullable=True))


def downgrade() -> None:
    # Dropping a column recreates the table on SQLite: keep its AUTOINCREMENT (0003).
    with op.batch_alter_table("migrations", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_column("host")
