"""Tier roots never overlap (RELIABILITY.md row 31): equal or nested roots, a root reached
through a symlink, nested bucket prefixes and a catalog inside a tier root are refused at
start-up, naming both; nothing is adopted twice and nothing deleted through an alias."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tests.helpers import cli_text
from tiering.config import EngineConfig, TierConfig
from tiering.engine import Engine
from tiering.tiers import Tiers, overlap


def _dirs(**roots: Path) -> list[TierConfig]:
    return [TierConfig(name, path=root) for name, root in roots.items()]


def test_nested_and_equal_roots_are_refused_naming_both(tmp_path: Path) -> None:
    outer, inner = tmp_path / "outer", tmp_path / "outer" / "inner"
    why = overlap(_dirs(a=outer, b=inner))
    assert why is not None and "'b'" in why and "'a'" in why and "nest" in why
    why = overlap(_dirs(a=outer, b=outer))
    assert why is not None and "same root" in why
    with pytest.raises(ValueError, match="must not nest"):
        Tiers(_dirs(a=inner, b=outer))
    assert overlap(_dirs(a=tmp_path / "ab", b=tmp_path / "a")) is None  # a prefix, not a parent


def test_a_root_reached_through_a_symlink_is_the_same_root(tmp_path: Path) -> None:
    real = tmp_path / "disk"
    real.mkdir()
    os.symlink(real, tmp_path / "alias")
    why = overlap(_dirs(a=real, b=tmp_path / "alias" / "sub"))
    assert why is not None and "inside tier 'a'" in why


def test_bucket_prefixes_overlap_only_in_one_bucket_at_one_endpoint() -> None:
    def s3(name: str, url: str, endpoint: str = "http://s3") -> TierConfig:
        return TierConfig(name, kind="object", url=url, endpoint_url=endpoint)

    assert overlap([s3("x", "s3://b/models"), s3("y", "s3://b/models/llm")]) is not None
    assert overlap([s3("x", "s3://b"), s3("y", "s3://b/anything")]) is not None
    assert overlap([s3("x", "s3://b/models"), s3("y", "s3://c/models")]) is None
    assert overlap([s3("x", "s3://b/m", "http://one"), s3("y", "s3://b/m", "http://two")]) is None


def test_the_catalog_inside_a_tier_root_is_refused(tmp_path: Path) -> None:
    why = overlap(_dirs(a=tmp_path), catalog=tmp_path / "catalog.db")
    assert why is not None and "catalog" in why
    assert overlap(_dirs(a=tmp_path / "nvme"), catalog=tmp_path / "catalog.db") is None


def _layout(tmp_path: Path, case: str) -> tuple[Path, Path]:
    """Two tier roots that overlap as ``case`` says, each already holding a file."""
    outer = tmp_path / "x"
    (outer / "inner").mkdir(parents=True)
    (outer / "top.bin").write_bytes(b"outer's")
    (outer / "inner" / "deep.bin").write_bytes(b"inner's")
    if case == "nested":
        return outer, outer / "inner"
    if case == "equal":
        return outer, outer
    os.symlink(outer, tmp_path / "alias")  # another name for the same directory
    return outer / "inner", tmp_path / "alias"


@pytest.mark.parametrize("case", ["nested", "equal", "symlink"])
@pytest.mark.parametrize("command", [["db", "upgrade"], ["scan"]])  # serve reads them alike
def test_start_up_refuses_overlap_and_adopts_or_deletes_nothing(
    tmp_path: Path, case: str, command: list[str]
) -> None:
    a, b = _layout(tmp_path, case)
    cfg = tmp_path / "tierd.toml"
    cfg.write_text(f'[[tiers]]\nname = "a"\npath = "{a}"\n[[tiers]]\nname = "b"\npath = "{b}"\n')
    data = tmp_path / "d"
    result = CliRunner().invoke(cli, [*command, "--config", str(cfg), "--data-dir", str(data)])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1, result.output  # one line, naming both
    assert "'a'" in result.output and "'b'" in result.output
    assert not data.exists(), "no catalog: nothing adopted"
    x = tmp_path / "x"
    files = {str(p.relative_to(x)): p.read_bytes() for p in x.rglob("*") if p.is_file()}
    assert files == {"top.bin": b"outer's", "inner/deep.bin": b"inner's"}  # nothing deleted


def test_an_engine_refuses_overlap_as_a_library_too(tmp_path: Path) -> None:
    a, b = _layout(tmp_path, "symlink")
    config = EngineConfig(tuple(_dirs(a=a, b=b)), catalog_url=f"sqlite:///{tmp_path / 'c.db'}")
    with pytest.raises(ValueError, match="inside tier 'b'"):
        Engine(config)
    assert not (tmp_path / "c.db").exists()


def test_start_up_refuses_nested_roots_and_writes_nothing(tmp_path: Path) -> None:
    cfg = tmp_path / "tierd.toml"
    cfg.write_text(
        f'[[tiers]]\nname = "a"\npath = "{tmp_path / "x"}"\n'
        f'[[tiers]]\nname = "b"\npath = "{tmp_path / "x" / "inner"}"\n'
    )
    args = ["tiers", "--config", str(cfg), "--data-dir", str(tmp_path / "d")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0
    assert "tier 'b'" in cli_text(result.output) and "tier 'a'" in cli_text(result.output)
    assert not (tmp_path / "x").exists() and not (tmp_path / "d" / "catalog.db").exists()


@pytest.fixture
def bind(tmp_path: Path) -> Iterator[Callable[[Path, Path], None]]:
    """``bind(src, dst)``: ``src`` also reached as ``dst`` (a bind mount, undone after)."""
    mounted: list[Path] = []

    def mount(src: Path, dst: Path) -> None:
        dst.mkdir(parents=True)
        done = subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot bind-mount here: {done.stderr.decode().strip()}")
        mounted.append(dst)

    yield mount
    for dst in reversed(mounted):
        subprocess.run(["umount", str(dst)], check=True)


def test_one_directory_under_two_names_is_one_root(
    tmp_path: Path, bind: Callable[[Path, Path], None]
) -> None:
    disk = tmp_path / "disk"
    (disk / "sub").mkdir(parents=True)
    alias = tmp_path / "mnt" / "alias"
    bind(disk, alias)  # as a container's two volumes of one host directory
    why = overlap(_dirs(a=disk, b=alias))
    assert why is not None and "same root" in why and "one directory" in why
    why = overlap(_dirs(a=disk, b=alias / "sub"))
    assert why is not None and "tier 'b'" in why and "inside tier 'a'" in why
    why = overlap(_dirs(a=disk), catalog=alias / "catalog.db")
    assert why is not None and "catalog" in why
    assert overlap(_dirs(a=disk / "sub", b=alias / "other")) is None  # siblings: both fine
