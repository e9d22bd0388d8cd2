"""The catalog's tests run on both backends: every engine and settings fixture here builds its
catalog on SQLite and on a real PostgreSQL (tests/pg_support.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from tests.pg_support import BACKENDS


@pytest.fixture(params=BACKENDS)
def catalog_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def empty_catalog_url(catalog_backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A catalog with no schema yet, on ``catalog_backend``."""
    if catalog_backend == "postgresql":
        return str(request.getfixturevalue("pg_empty_url"))
    return f"sqlite:///{tmp_path / 'c.db'}"


def run_sql(url: str, sql: str, params: dict[str, Any] | None = None) -> list[Any]:
    """One statement, committed, from a connection of its own (another writer than tierd's);
    the rows it returned."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            res = conn.execute(text(sql), params or {})
            return list(res.all()) if res.returns_rows else []
    finally:
        engine.dispose()
