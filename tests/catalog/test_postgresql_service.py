"""A PostgreSQL catalog everywhere SQLite works: the catalog_url setting (checked, normalised,
its password never shown), ``tierd db upgrade`` and ``tierd scan``, the service on a real
uvicorn server, with the same host refused a second serving process, and lost connections."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from app.cli import cli
from tests.catalog.conftest import run_sql
from tests.conftest import LiveServer, make_settings, wait_for
from tests.helpers import cli_text, put
from tiering.catalog.backends import normalize_url, redact
from tiering.engine import Engine
from tiering.errors import CatalogBusy, InvalidInput, Unavailable

runner = CliRunner()


@pytest.mark.parametrize(
    ("url", "normal"),
    [
        ("postgresql://u@db:5432/tierd", "postgresql+psycopg://u@db:5432/tierd"),
        ("postgresql+psycopg://u:pw@db/tierd", "postgresql+psycopg://u:pw@db/tierd"),
        ("sqlite:////var/lib/tierd/catalog.db", "sqlite:////var/lib/tierd/catalog.db"),
    ],
)
def test_catalog_urls_are_normalised(url: str, normal: str) -> None:
    assert normalize_url(url) == normal
    assert make_settings(Path("/tmp/x"), catalog_url=url).catalog_url == normal


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("mysql://u@db/tierd", "unsupported catalog URL"),
        ("postgresql+psycopg2://u:secret@db/tierd", "through psycopg 3"),
        ("postgresql://u:secret@db:5432", "names no database"),
        ("sqlite://", "needs a file"),
        ("sqlite:///:memory:", "needs a file"),
        ("not a url", "not a database URL"),
    ],
)
def test_unsupported_catalog_urls_are_refused_at_configuration(url: str, why: str) -> None:
    with pytest.raises(InvalidInput, match=why) as err:
        normalize_url(url)
    assert "secret" not in str(err.value)
    with pytest.raises(ValidationError, match=why):
        make_settings(Path("/tmp/x"), catalog_url=url)


def test_passwords_are_redacted() -> None:
    assert redact("postgresql+psycopg://u:hunter2@db/t") == "postgresql+psycopg://u:***@db/t"


def _run(*args: str, url: str) -> tuple[int, str]:
    result = runner.invoke(cli, list(args), env={"TIERD_CATALOG_URL": url})
    return result.exit_code, cli_text(result.output)


def test_cli_upgrades_and_scans_a_postgresql_catalog(tmp_path: Path, pg_empty_url: str) -> None:
    d = tmp_path / "d"
    (d / "ssd/m").mkdir(parents=True)
    (d / "ssd/m/w.bin").write_bytes(b"weights")
    code, out = _run("db", "upgrade", "--data-dir", str(d), url=pg_empty_url)
    assert code == 0 and "up to date" in out and "postgresql+psycopg://" in out
    code, out = _run("scan", "--data-dir", str(d), "--check", "--json", url=pg_empty_url)
    assert code == 1 and json.loads(out)["adopted"] == ["m/w.bin"]
    code, out = _run("scan", "--data-dir", str(d), url=pg_empty_url)
    assert code == 0 and "m/w.bin" in out
    code, out = _run("stat", "m/w.bin", "--data-dir", str(d), "--json", url=pg_empty_url)
    assert json.loads(out)["tier"] == "ssd"
    assert not (d / "catalog.db").exists()  # nothing went to SQLite


def test_the_service_serves_from_a_postgresql_catalog(tmp_path: Path, pg_url: str) -> None:
    settings = make_settings(tmp_path / "d", catalog_url=pg_url, host_id="gpu-a")
    with LiveServer(settings) as srv, srv.client() as c:
        ready = c.get("/readyz")
        assert ready.status_code == 200 and ready.json()["checks"]["catalog"]["ok"]
        put = c.put("/v1/files/content", params={"path": "m/a.bin"}, content=b"hello")
        assert put.status_code == 201
        fid = put.json()["id"]
        assert c.get(f"/v1/files/{fid}/content").content == b"hello"
        assert c.post("/v1/migrations", json={"file_id": fid, "to_tier": "hdd"}).status_code < 300
        wait_for(lambda: c.get(f"/v1/files/{fid}").json()["tier"] == "hdd", what="the move")
        assert [f["path"] for f in c.get("/v1/files").json()["items"]] == ["m/a.bin"]
        # The same host may not run a second tierd on this catalog; the CLI points at REST.
        env = {"TIERD_CATALOG_URL": pg_url, "TIERD_HOST_ID": "gpu-a"}
        result = runner.invoke(cli, ["scan", "--data-dir", str(tmp_path / "d")], env=env)
        out = cli_text(result.output)
        assert result.exit_code == 1, out
        assert "host id 'gpu-a' is already serving" in out and "POST /v1/scan" in out


@pytest.mark.parametrize("catalog_backend", ["postgresql"])
def test_lost_connections_are_unavailable_and_the_next_call_reconnects(
    eng: Engine, pg_url: str
) -> None:
    rec = put(eng, "a.bin", b"a")
    eng.catalog.get(rec.id)  # the pool holds a connection now
    # What a server restart does to every session (but this test's own).
    killed = run_sql(
        pg_url,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid() "
        "AND application_name = 'tierd'",
    )
    assert killed
    with pytest.raises(Unavailable, match="cannot be reached") as err:
        eng.catalog.get(rec.id)
    assert not isinstance(err.value, CatalogBusy)
    assert eng.catalog.get(rec.id).id == rec.id  # a fresh connection
    eng.migrate(rec.id, "ssd")  # and writes go on
