"""Fleet jobs with one task per host, and each host's own heat of the files it reads.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23

``fleet_jobs`` is one fleet-wide request (a prefetch of a model or of paths to some hosts);
``fleet_tasks`` holds its part for each host, which only that host runs: it claims the row
(``claimed_by``, ``claim_expires``, renewed while it works), so a host that dies mid-task
leaves a claim that expires, and the task runs again when the host returns.

``host_heat`` is one host's decayed access count of a file, beside ``files.heat``, which every
host's accesses add to (the fleet's heat: the sum of the hosts' heats, as decay is linear).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fleet_jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("target", sa.String(32), nullable=False),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("created_by", sa.String(255), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("cancelled_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_fleet_jobs"),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "fleet_tasks",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("claimed_by", sa.String(255), nullable=True),
        sa.Column("claim_expires", sa.Float(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("files_total", sa.Integer(), nullable=False),
        sa.Column("bytes_total", sa.BigInteger(), nullable=False),
        sa.Column("files_done", sa.Integer(), nullable=False),
        sa.Column("bytes_done", sa.BigInteger(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("errors", sa.Text(), nullable=True),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["fleet_jobs.id"],
            name="fk_fleet_tasks_job_id_fleet_jobs",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_fleet_tasks"),
        sa.UniqueConstraint("job_id", "host", name="uq_fleet_tasks_job_id"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_fleet_tasks_host_state", "fleet_tasks", ["host", "state"])
    op.create_table(
        "host_heat",
        sa.Column("file_id", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("heat", sa.Float(), nullable=False),
        sa.Column("heat_at", sa.Float(), nullable=False),
        sa.Column("access_count", sa.BigInteger(), nullable=False),
        sa.Column("last_access", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["file_id"], ["files.id"], name="fk_host_heat_file_id_files", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("file_id", "host", name="pk_host_heat"),
    )
    op.create_index("ix_host_heat_host", "host_heat", ["host"])


def downgrade() -> None:
    op.drop_index("ix_host_heat_host", table_name="host_heat")
    op.drop_table("host_heat")
    op.drop_index("ix_fleet_tasks_host_state", table_name="fleet_tasks")
    op.drop_table("fleet_tasks")
    op.drop_table("fleet_jobs")
