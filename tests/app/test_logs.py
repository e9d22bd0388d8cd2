"""Request ids (header, error bodies, log lines), JSON logs, and a quiet start-up."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from app.logs import JsonFormatter, TextFormatter, request_id_var, sane_request_id
from app.main import create_app
from app.settings import Settings, get_settings
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def boom_client(settings: Settings) -> Iterator[TestClient]:
    app = create_app(settings)

    async def boom() -> None:
        raise RuntimeError("kaboom")

    app.add_api_route("/boom", boom)
    with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as c:
        yield c


def test_request_id_generated_and_echoed(client: Any) -> None:
    r = client.get("/healthz")
    rid = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid)
    assert client.get("/healthz").headers["x-request-id"] != rid
    r = client.get("/healthz", headers={"X-Request-ID": "abc.DEF-123_x"})
    assert r.headers["x-request-id"] == "abc.DEF-123_x"


@pytest.mark.parametrize("bad", ["a b", "x" * 129, "évil", "a;b", '"q"'])
def test_bad_incoming_request_id_replaced(client: Any, bad: str) -> None:
    r = client.get("/healthz", headers={"X-Request-ID": bad.encode("utf-8")})
    rid = r.headers["x-request-id"]
    assert rid != bad and re.fullmatch(r"[0-9a-f]{32}", rid)


def test_sane_request_id() -> None:
    assert sane_request_id("x" * 128) == "x" * 128
    assert sane_request_id("x" * 129) is None
    assert sane_request_id("") is None
    assert sane_request_id(None) is None


def test_error_body_and_header_carry_request_id(client: Any) -> None:
    r = client.get("/no/such/route", headers={"X-Request-ID": "req-404"})
    assert r.status_code == 404
    assert r.headers["x-request-id"] == "req-404"
    err = r.json()["error"]
    assert err["code"] == "not_found" and err["message"] and err["request_id"] == "req-404"
    # An engine error (NotFound) with a generated id: the body's equals the header's.
    r = client.get("/v1/files/999")
    assert r.status_code == 404
    assert r.json()["error"]["request_id"] == r.headers["x-request-id"]


def test_unhandled_error_has_request_id_in_body_header_and_log(boom_client: TestClient) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("app.errors")
    logger.addHandler(handler)
    try:
        r = boom_client.get("/boom", headers={"X-Request-ID": "req-500"})
    finally:
        logger.removeHandler(handler)
    assert r.status_code == 500
    assert r.headers["x-request-id"] == "req-500"
    assert r.json()["error"] == {
        "code": "internal_error",
        "message": "internal error: RuntimeError",
        "request_id": "req-500",
    }
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 1
    entry = lines[0]
    assert entry["level"] == "ERROR" and entry["logger"] == "app.errors"
    assert entry["message"] == "unhandled error" and entry["request_id"] == "req-500"
    assert "RuntimeError: kaboom" in entry["exc_info"]


def _record(msg: str = "hello %s", args: tuple[Any, ...] = ("world",), exc: Any = None) -> Any:
    return logging.LogRecord("tierd", logging.INFO, __file__, 1, msg, args, exc)


def test_json_formatter_fields() -> None:
    fmt = JsonFormatter()
    entry = json.loads(fmt.format(_record()))
    assert set(entry) == {"ts", "level", "logger", "message"}
    assert entry["message"] == "hello world" and entry["level"] == "INFO"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry["ts"])
    token = request_id_var.set("rid-1")
    try:
        line = fmt.format(_record("multi\nline", ()))
        try:
            raise ValueError("bad")
        except ValueError:
            exc = json.loads(fmt.format(_record("oops", (), sys.exc_info())))
        text = TextFormatter().format(_record())
    finally:
        request_id_var.reset(token)
    assert "\n" not in line and json.loads(line)["request_id"] == "rid-1"
    assert exc["request_id"] == "rid-1" and "ValueError: bad" in exc["exc_info"]
    assert text.endswith("tierd: hello world [rid-1]")


def test_log_format_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert get_settings(data_dir=tmp_path).log_format == "text"
    monkeypatch.setenv("TIERD_LOG_FORMAT", "json")
    assert get_settings(data_dir=tmp_path).log_format == "json"
    monkeypatch.setenv("TIERD_LOG_FORMAT", "xml")
    with pytest.raises(ValueError):
        get_settings(data_dir=tmp_path)


def test_serve_json_logs(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
    args = [sys.executable, "-m", "app.cli", "serve", "--data-dir", str(tmp_path / "d")]
    args += ["--port", str(port), "--log-format", "json", "--log-level", "info"]
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                r = httpx.get(f"{url}/healthz", headers={"X-Request-ID": "probe-1"}, timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "tierd serve did not start"
                time.sleep(0.1)
        assert r.headers["x-request-id"] == "probe-1"
        r = httpx.get(f"{url}/nope", headers={"X-Request-ID": "probe-2"}, timeout=5)
        assert r.status_code == 404 and r.json()["error"]["request_id"] == "probe-2"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines, "no log lines"
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    for entry in entries:
        assert {"ts", "level", "logger", "message"} <= set(entry), entry
    loggers = {e["logger"] for e in entries}
    assert "uvicorn.error" in loggers
    access = [e for e in entries if e["logger"] == "uvicorn.access"]
    assert {e.get("request_id") for e in access} >= {"probe-1", "probe-2"}
    assert any(e.get("status") == 404 and e.get("path") == "/nope" for e in access)
    # Start-up is a few lines: none of Alembic's INFO (its plugin list, migration steps).
    assert not [e for e in entries if e["logger"].startswith("alembic")], entries
    assert not any("plugin" in e["message"] for e in entries)
