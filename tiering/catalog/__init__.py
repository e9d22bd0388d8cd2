"""The catalog: SQLAlchemy models, the database (SQLite, or PostgreSQL for hosts that share
one) and the repository."""

from tiering.catalog.copies import Copies, CopyRow
from tiering.catalog.db import Database, decay, upgrade
from tiering.catalog.lock import CatalogLock
from tiering.catalog.models import (
    Copy,
    FileRecord,
    FileState,
    Migration,
    MigrationPhase,
    PolicyVersion,
)
from tiering.catalog.repo import Catalog, NewFile, TierUsage

__all__ = [
    "Catalog",
    "Copies",
    "Copy",
    "CopyRow",
    "Database",
    "FileRecord",
    "FileState",
    "Migration",
    "MigrationPhase",
    "NewFile",
    "PolicyVersion",
    "TierUsage",
    "decay",
    "upgrade",
    "CatalogLock",
]
