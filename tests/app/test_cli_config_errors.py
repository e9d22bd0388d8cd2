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
        ["explain", "x"],
        ["migrations"],
        ["migrate"],  # changes files: none to change either
        ["pin", "x"],
        ["unpin", "x"],
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


def test_paths_and_messages_are_printed_as_written(tmp_path: Path) -> None:
    """No output is read as rich markup: a bracket in a file name was taken for a style (and
    dropped), and ``[/x]`` in a message raised MarkupError in place of the error."""
    d = tmp_path / "d"
    (d / "ssd").mkdir(parents=True)
    (d / "ssd" / "[bold]w.bin").write_bytes(b"weights")
    assert _run("db", "upgrade", "--data-dir", str(d))[0] == 0
    code, output = _run("scan", "--data-dir", str(d))
    assert code == 0 and "[bold]w.bin" in output, output
    code, output = _run("ls", "--data-dir", str(d))
    assert code == 0 and "[bold]w.bin" in output, output
    code, output = _run("stat", "[bold]w.bin", "--data-dir", str(d))
    assert code == 0 and "[bold]w.bin" in output, output
    code, output = _run("stat", "a[/x]b.bin", "--data-dir", str(d))
    assert code == 1 and output == "error: no file at path 'a[/x]b.bin'\n", output


def test_a_toml_syntax_error_names_the_file_and_the_place(tmp_path: Path) -> None:
    cfg = tmp_path / "tierd.toml"
    cfg.write_text('port = 8470\ndata_dir = "/x\n')
    code, output = _run("tiers", "--config", str(cfg))
    assert code == 2 and output.count("\n") == 1, output
    assert output.startswith(f"invalid configuration: {cfg}: ") and "line 2" in output, output
