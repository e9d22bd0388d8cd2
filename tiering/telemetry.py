"""Counts the service's metrics read from the catalog at scrape time (no per-file detail)."""

from __future__ import annotations

from sqlalchemy import func, select

from tiering.catalog import Migration
from tiering.engine import Engine

__all__ = ["migration_counts"]


def migration_counts(engine: Engine) -> dict[str, int]:
    """Migrations in the journal by phase (``done``, ``aborted``, ``failed``, in flight...)."""
    if engine.db is None:
        return {}
    q = select(Migration.phase, func.count()).group_by(Migration.phase)
    with engine.db.read() as s:
        return {str(phase): int(n) for phase, n in s.execute(q)}
