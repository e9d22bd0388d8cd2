"""Configuration errors are one plain line (never rich markup: a pattern is printed as
written), and commands that only read make nothing where there is no catalog (issue 40)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import cli


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


def test_a_config_error_is_one_line_with_its_pattern_as_written(tmp_path: Path) -> None:
    cfg = tmp_path / "tierd.toml"
    cfg.write_text(f'[[tiers]]\nname = "Bad Name"\npath = "{tmp_path / "t"}"\n')
    code, output = _run("tiers", "--config", str(cfg), "--data-dir", str(tmp_path / "d"))
    assert code == 2
    assert output.count("\n") == 1, output  # one line, at any terminal width
    assert output.startswith("invalid configuration: tiers.0.name: ")
    assert "'^[a-z][a-z0-9_-]{0,63}$'" in output  # rich markup would eat the brackets
    assert "pydantic.dev" not in output and "input_value" not in output


def test_several_errors_are_joined_on_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "tierd.toml"
    cfg.write_text('port = "x"\nmax_upload_bytes = -1\n')
    code, output = _run("tiers", "--config", str(cfg), "--data-dir", str(tmp_path / "d"))
    assert code == 2 and output.count("\n") == 1, output
    assert "port: " in output and "max_upload_bytes: " in output and "; " in output


@pytest.mark.parametrize(
    "command",
    [
        ["tiers"],
        ["ls"],
        ["stat", "x"],
        ["models"],
        ["plan"],
        ["scan", "--check"],
        ["policy", "show"],
    ],
)
def test_reading_commands_refuse_a_data_dir_without_a_catalog(
    tmp_path: Path, command: list[str]
) -> None:
    missing = tmp_path / "typo"
    code, output = _run(*command, "--data-dir", str(missing))
    assert code == 2, output
    assert "no catalog at" in output and str(missing) in output.replace("\n", "")
    assert not missing.exists()  # nothing made: no directory, no catalog, no tiers
