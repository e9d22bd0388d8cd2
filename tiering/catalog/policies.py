"""Stored policy versions: every policy ever set, the highest version in force."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tiering.catalog.db import Database
from tiering.catalog.models import PolicyVersion

__all__ = ["PolicyStore", "StoredPolicy"]


@dataclass(frozen=True)
class StoredPolicy:
    version: int
    document: dict[str, Any]
    created_at: float
    author: str | None


class PolicyStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def latest(self) -> StoredPolicy | None:
        with self.db.read() as s:
            row = s.scalar(select(PolicyVersion).order_by(PolicyVersion.version.desc()).limit(1))
        if row is None:
            return None
        return StoredPolicy(row.version, json.loads(row.document), row.created_at, row.author)

    def latest_version(self) -> int:
        with self.db.read() as s:
            return int(s.scalar(select(func.max(PolicyVersion.version))) or 0)

    def save(self, document: dict[str, Any], *, author: str | None = None) -> StoredPolicy:
        """Store ``document`` as the next version (the caller validated it)."""
        now = time.time()

        def body(s: Session) -> int:
            version = int(s.scalar(select(func.max(PolicyVersion.version))) or 0) + 1
            s.add(
                PolicyVersion(
                    version=version,
                    document=json.dumps(document, sort_keys=True),
                    created_at=now,
                    author=author,
                )
            )
            s.flush()
            return version

        # Two hosts saving at once pick the same number: the second runs again and takes the
        # next one (the version is the primary key).
        version = self.db.transact(body, retry_unique=True)
        return StoredPolicy(version, document, now, author)
