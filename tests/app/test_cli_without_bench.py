"""``tierd`` without the bench package: every command but ``bench`` works, and ``bench`` says why.

The image and a plain wheel install may ship without ``tierd_bench``; ``app.cli`` once imported it
at load time, so the container restarted in a loop on ``ModuleNotFoundError``. Each case runs in
a fresh interpreter where importing ``tierd_bench`` fails, as it does where it is not installed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_BLOCK = "import sys; sys.modules['tierd_bench'] = None; "


def _tierd(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    code = _BLOCK + "sys.argv = ['tierd', *sys.argv[1:]]; from app.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "100", "TIERD_DATA_DIR": str(tmp_path)},
    )


def test_the_cli_loads_and_lists_bench_without_the_package(tmp_path: Path) -> None:
    done = _tierd("--help", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "serve" in done.stdout and "bench" in done.stdout
    assert "not available" in done.stdout


def test_bench_without_the_package_is_a_clear_error(tmp_path: Path) -> None:
    done = _tierd("bench", "models", "--size", "1MiB", tmp_path=tmp_path)
    assert done.returncode == 2
    assert "tierd bench needs the tierd_bench package" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_catalog_command_runs_without_the_package(tmp_path: Path) -> None:
    made = _tierd("db", "upgrade", "--data-dir", str(tmp_path), tmp_path=tmp_path)
    assert made.returncode == 0, made.stderr
    done = _tierd("ls", "--data-dir", str(tmp_path), "--json", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_server_imports_without_the_package() -> None:
    code = _BLOCK + "from app.main import create_app; import app.cli; print('ok')"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
