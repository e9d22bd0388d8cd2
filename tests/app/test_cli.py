"""The tierd CLI, run in-process with typer's runner against a real data dir."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tests.helpers import cli_text

runner = CliRunner()


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(cli, list(args))
    # rich wraps long lines at the terminal's width: compare words, not line breaks.
    return result.exit_code, cli_text(result.output)


def test_scan_tiers_ls_stat(tmp_path: Path) -> None:
    d = tmp_path / "d"
    (d / "ssd/m").mkdir(parents=True)
    (d / "ssd/m/w.bin").write_bytes(b"weights")
    code, out = run("db", "upgrade", "--data-dir", str(d))
    assert code == 0 and "up to date" in out
    code, out = run("scan", "--data-dir", str(d), "--check", "--json")
    assert code == 1 and json.loads(out)["adopted"] == ["m/w.bin"]
    code, out = run("scan", "--data-dir", str(d))
    assert code == 0 and "adopted" in out and "m/w.bin" in out
    code, out = run("scan", "--data-dir", str(d), "--check")
    assert code == 0
    code, out = run("tiers", "--data-dir", str(d), "--json")
    tiers = json.loads(out)
    assert [t["name"] for t in tiers] == ["nvme", "ssd", "hdd"] and tiers[1]["files"] == 1
    code, out = run("tiers", "--data-dir", str(d))
    assert code == 0 and "ssd" in out
    code, out = run("ls", "--data-dir", str(d), "--json")
    assert [f["path"] for f in json.loads(out)] == ["m/w.bin"]
    code, out = run("ls", "m/", "--data-dir", str(d))
    assert code == 0 and "m/w.bin" in out
    code, out = run("stat", "m/w.bin", "--data-dir", str(d), "--json")
    assert json.loads(out)["size"] == 7
    code, out = run("stat", "m/w.bin", "--data-dir", str(d))
    assert code == 0 and "checksum" in out


def test_errors_are_plain(tmp_path: Path) -> None:
    d = str(tmp_path / "d")
    assert run("db", "upgrade", "--data-dir", d)[0] == 0  # reading commands need a catalog
    code, out = run("stat", "nope.bin", "--data-dir", d)
    assert code == 1 and "no file at path" in out
    code, out = run("stat", "../x", "--data-dir", d)
    assert code == 1 and "not normal" in out
    code, out = run("ls", "--tier", "floppy", "--data-dir", d)
    assert code == 1 and "no tier named" in out
    code, out = run("serve", "--data-dir", d, "--host", "0.0.0.0")
    assert code == 2 and "refusing" in out
    code, out = run("tiers", "--config", str(tmp_path / "missing.toml"))
    assert code == 2 and "does not exist" in out


def test_tierd_without_the_server_extra_says_what_to_install() -> None:
    # `pip install tierd` is the client alone; its `tierd` command must say why it cannot serve.
    code = "import sys\nsys.modules['typer'] = None\nimport app\napp.main()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "pip install 'tierd[server]'" in r.stderr and "typer" in r.stderr


def test_a_second_serve_on_one_data_dir_is_one_line_naming_the_first(tmp_path: Path) -> None:
    from app.settings import get_settings
    from tiering.engine import Engine

    d = tmp_path / "d"
    with Engine(get_settings(data_dir=d, watch=False).engine_config()):
        result = runner.invoke(cli, ["serve", "--data-dir", str(d), "--port", "1"])
    out = cli_text(result.output)
    assert result.exit_code == 1, out
    assert f"another tierd (pid {os.getpid()}) is already serving the catalog" in out
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_a_serve_run_in_process_logs_to_stderr_as_it_is_now(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """serve configures logging, then (here) stops; stderr is swapped back and its stand-in
    closed. Later records go to stderr as it is then, not to the closed stand-in."""
    code, out = run("serve", "--data-dir", str(tmp_path / "d"), "--host", "0.0.0.0")
    assert code == 2 and "refusing" in out
    logging.getLogger("tierd.test").warning("a record after serve")
    err = capsys.readouterr().err
    assert "Logging error" not in err and "a record after serve" in err
