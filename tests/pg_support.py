"""A real PostgreSQL for the tests: Debian's server (``/usr/lib/postgresql/<v>/bin``) in a temp
directory on a free loopback port, for the whole session, and a fresh database per test. The
server itself is :class:`tierd_bench._postgres.PgServer`, which ``tierd bench catalog`` starts
the same way.

initdb refuses to run as root, so as root the server runs as the ``postgres`` user (``setpriv``,
which also asks the kernel to stop the server if pytest dies: no server outlives its session).
Authentication is ``trust`` on loopback. A database built by the migrations once per session is
the template of each test's database (``CREATE DATABASE ... TEMPLATE`` copies files, no SQL),
so a test pays a few milliseconds, not an Alembic run. Where the binaries, the ``postgres`` user
or psycopg are missing, the tests that need PostgreSQL skip, saying which.

Fixtures (the root conftest lists this module in ``pytest_plugins``):

- ``pg_server``: the session's :class:`PgServer`;
- ``pg_url``: a fresh database at the schema's head, dropped after the test;
- ``pg_empty_url``: a fresh database with no schema (for migration tests);
- ``private_pg``: a :class:`PausablePg` of the test's own, which it may stop and start again
  (an outage: the session's shared server is never stopped);
- ``catalog_backend``: ``"sqlite"`` unless a test or a conftest parametrises it (tests/catalog
  runs both), and ``catalog_overrides``, the settings that put the catalog there, which the
  engine fixtures (``settings``, ``esettings``) apply.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierd_bench._postgres import PgServer, find_bindir, why_no_postgresql

__all__ = [
    "BACKENDS",
    "PausablePg",
    "PgServer",
    "catalog_backend",
    "catalog_overrides",
    "find_bindir",
    "pg_empty_url",
    "pg_server",
    "pg_url",
    "private_pg",
    "why_no_postgresql",
]

#: The catalog backends a parametrised test runs on.
BACKENDS = ("sqlite", "postgresql")


class PausablePg(PgServer):
    """A private server that can be stopped and started again on its data directory and port."""

    def halt(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)  # fast shutdown: sessions are cut
        self.proc.wait(timeout=30)

    def resume(self) -> None:
        assert self._launch(self.root / "data"), self.log_tail()


@pytest.fixture(scope="session")
def _pg_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path | None]:
    """A stopped cluster with the migrated template, made once: each private server starts
    from a copy of it (initdb and the migrations cost seconds a server)."""
    if why_no_postgresql() is not None:
        yield None
        return
    dest = tmp_path_factory.mktemp("pg-cluster") / "data"
    with PausablePg() as first:
        first.save_cluster(dest)
    try:
        yield dest
    finally:
        shutil.rmtree(dest, ignore_errors=True)


@pytest.fixture
def private_pg(_pg_cluster: Path | None) -> Iterator[PausablePg]:
    reason = why_no_postgresql()
    if reason is not None:
        pytest.skip(f"no PostgreSQL: {reason}")
    with PausablePg(cluster=_pg_cluster) as server:
        yield server


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    reason = why_no_postgresql()
    if reason is not None:
        pytest.skip(f"no PostgreSQL: {reason}")
    with PgServer() as server:
        yield server


def _database(server: PgServer, *, migrated: bool) -> Iterator[str]:
    name = server.create_database(migrated=migrated)
    try:
        yield server.url(name)
    finally:
        server.drop_database(name)


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """A fresh database at the schema's head."""
    yield from _database(pg_server, migrated=True)


@pytest.fixture
def pg_empty_url(pg_server: PgServer) -> Iterator[str]:
    """A fresh database with no tables."""
    yield from _database(pg_server, migrated=False)


@pytest.fixture
def catalog_backend() -> str:
    """The engine fixtures' catalog: SQLite, unless parametrised (``BACKENDS``)."""
    return "sqlite"


@pytest.fixture
def catalog_overrides(catalog_backend: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    """Settings overrides that put a test's catalog on ``catalog_backend`` (nothing for SQLite,
    whose catalog is the data directory's default)."""
    if catalog_backend == "postgresql":
        return {"catalog_url": request.getfixturevalue("pg_url")}
    return {}
