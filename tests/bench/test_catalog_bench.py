"""``tierd bench catalog`` for a fraction of a second: on SQLite alone (PostgreSQL's rows
skipped, saying why), and against the tests' real PostgreSQL through ``--catalog-url`` (one
host and two host processes). Only the shape of the result and that work was counted are
checked, never a speed; and the bench must leave the server as it found it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from app.cli import cli
from tests.pg_support import PgServer
from tierd_bench.catalog import run

from .test_report import assert_shared_shape

runner = CliRunner()
FIGURES = ("flush", "moves_1", "moves_4")


def _said(output: str) -> str:
    # The message as one line, without the frame rich draws around usage errors.
    return " ".join(output.replace("│", " ").split())


def _databases(server: PgServer) -> set[str]:
    return {r[0] for r in server.execute("postgres", "SELECT datname FROM pg_database")}


def test_sqlite_alone_when_no_postgresql_can_be_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No setpriv on PATH: the bench cannot start its own PostgreSQL, and says so.
    monkeypatch.setenv("PATH", str(tmp_path))
    said: list[str] = []
    report = run(seconds=0.05, runs=2, hosts=3, say=said.append)
    doc = report.as_dict()
    assert_shared_shape(doc, "catalog")
    rows = doc["rows"]
    assert list(rows) == [
        "sqlite_flush", "pg_flush", "sqlite_moves_1", "pg_moves_1",
        "sqlite_moves_4", "pg_moves_4", "pg_moves_3_hosts",
    ]  # fmt: skip
    for key in FIGURES:
        assert rows[f"sqlite_{key}"]["value"] > 0
        pg = rows[f"pg_{key}"]
        assert pg["value"] is None and pg["ratio"] is None and "setpriv" in pg["note"]
    assert rows["pg_moves_3_hosts"]["value"] is None
    assert doc["setup"]["postgresql"].startswith("skipped: setpriv")
    assert any("PostgreSQL rows skipped" in line for line in said)


# Suite time (7 s of a worker): the bench's SQLite run stays in CI; the catalog's own tests run
# every query on PostgreSQL.
@pytest.mark.slow
def test_against_an_existing_postgresql(tmp_path: Path, pg_server: PgServer, pg_url: str) -> None:
    before = _databases(pg_server)
    out = tmp_path / "catalog.json"
    args = ["--seconds", "0.1", "--runs", "2", "--hosts", "2", "--catalog-url", pg_url]
    result = runner.invoke(cli, ["bench", "catalog", *args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc: dict[str, Any] = json.loads(out.read_text())
    assert_shared_shape(doc, "catalog")
    rows = doc["rows"]
    for key in FIGURES:
        assert rows[f"sqlite_{key}"]["value"] > 0 and rows[f"pg_{key}"]["value"] > 0
        assert rows[f"pg_{key}"]["vs"] == f"sqlite_{key}"
        assert rows[f"pg_{key}"]["ratio"] > 0 and rows[f"pg_{key}"]["target"] == ">= 0.5x"
    fleet = rows["pg_moves_2_hosts"]
    assert fleet["value"] > 0 and fleet["vs"] == "pg_moves_1" and fleet["target"] == "> 1x"
    assert doc["setup"]["runs"] == 2 and "scratch database" in doc["setup"]["postgresql"]
    assert "PostgreSQL: moves, 2 hosts at once (total)" in result.stdout
    # Measured in a scratch database, dropped afterwards: the URL's own catalog is untouched.
    assert _databases(pg_server) == before
    dbname = make_url(pg_url).database
    assert dbname is not None
    assert pg_server.execute(dbname, "SELECT count(*) FROM files") == [(0,)]


def test_a_role_without_createdb_is_refused_and_nothing_is_written(
    pg_server: PgServer, pg_url: str
) -> None:
    pg_server.execute("postgres", "DROP ROLE IF EXISTS tierd_bench_reader")
    pg_server.execute("postgres", "CREATE ROLE tierd_bench_reader LOGIN")
    try:
        url = make_url(pg_url).set(username="tierd_bench_reader").render_as_string(False)
        before = _databases(pg_server)
        result = runner.invoke(cli, ["bench", "catalog", "--seconds", "0.05", "--runs", "1",
                                     "--hosts", "0", "--catalog-url", url])  # fmt: skip
        assert result.exit_code == 2
        message = _said(result.output)
        assert "needs CREATEDB" in message and "permission denied" in message
        assert _databases(pg_server) == before
    finally:
        pg_server.execute("postgres", "DROP ROLE tierd_bench_reader")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--catalog-url", "sqlite:///tmp/x.db"], "must be postgresql+psycopg"),
        (["--catalog-url", "mysql://db/x"], "unsupported catalog URL"),
        (["--runs", "0"], "--runs"),
        (["--hosts", "-1"], "--hosts"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    result = runner.invoke(cli, ["bench", "catalog", *args])
    assert result.exit_code == 2 and message in _said(result.output)
