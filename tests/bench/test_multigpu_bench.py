"""``tierd bench multi-gpu`` refuses clearly on a host with fewer than two GPUs (its
measures run on the 2-GPU machine)."""

from __future__ import annotations

import importlib

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tierd_bench.multigpu import run


def _gpus() -> int:
    try:
        return int(importlib.import_module("cupy").cuda.runtime.getDeviceCount())
    except Exception:
        return 0


pytestmark = pytest.mark.skipif(_gpus() >= 2, reason="this host has 2 GPUs: the bench would run")


def test_refuses_below_two_gpus() -> None:
    with pytest.raises(RuntimeError, match="at least 2 GPUs"):
        run(64 << 20)
    result = CliRunner().invoke(cli, ["bench", "multi-gpu", "--size", "64MiB"])
    assert result.exit_code == 2
    assert "at least 2 GPUs" in result.output
