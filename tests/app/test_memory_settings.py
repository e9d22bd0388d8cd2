"""Configuring a memory tier: ``[[tiers]] kind = "memory"`` with a quota, first and alone; the
engine gets it beside the storage tiers, which keep their ranks; ``TIERD_HOST_ID`` names the
host in the catalog's copies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from app.settings import get_settings
from tiering.config import EngineConfig, TierConfig

MiB = 1 << 20


def _tiers(root: Path, *memory: dict[str, Any], first: bool = True) -> list[dict[str, Any]]:
    disks = [{"name": n, "path": root / n} for n in ("nvme", "hdd")]
    return [*memory, *disks] if first else [*disks, *memory]


RAM = {"name": "ram", "kind": "memory", "quota_bytes": 64 * MiB}


def test_a_memory_tier_sits_above_storage_tiers_that_keep_their_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERD_HOST_ID", "gpu-node-7")
    s = get_settings(data_dir=tmp_path, tiers=_tiers(tmp_path, RAM))
    cfg = s.engine_config()
    assert cfg.memory == TierConfig("ram", quota_bytes=64 * MiB, kind="memory")
    assert [t.name for t in cfg.tiers] == ["nvme", "hdd"]  # what GpuDirectStorage ranks 0..
    assert cfg.tier_names() == ["ram", "nvme", "hdd"]  # what the policy has rules for
    assert cfg.host_id == "gpu-node-7"
    # The same split when a library user lists the memory tier with the others.
    lib = EngineConfig(tiers=(cfg.memory, *cfg.tiers), catalog_url="sqlite:////x.db")
    assert lib.memory == cfg.memory and lib.tiers == cfg.tiers and lib.host_id


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        (lambda r: _tiers(r, RAM, first=False), "must be listed first"),
        (lambda r: _tiers(r, RAM, RAM | {"name": "ram2"}), "at most one memory tier"),
        (lambda r: [RAM], "list at least one directory or bucket tier"),
        (lambda r: _tiers(r, RAM | {"quota_bytes": None}), "needs quota_bytes"),
        (lambda r: _tiers(r, RAM | {"path": r / "ram"}), "takes no path or url"),
        (lambda r: _tiers(r, {"name": "x", "kind": "object", "path": r / "x"}), "takes a url"),
    ],
)
def test_bad_memory_tier_configurations(tmp_path: Path, tiers: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        get_settings(data_dir=tmp_path, tiers=tiers(tmp_path))


def test_the_memory_tier_is_no_default_tier(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="not one of the storage tiers"):
        get_settings(data_dir=tmp_path, tiers=_tiers(tmp_path, RAM), default_tier="ram")


def test_engine_config_checks_a_library_users_memory_tier() -> None:
    disk = TierConfig("nvme", Path("/n"))
    ram = TierConfig("ram", quota_bytes=MiB, kind="memory")
    url = "sqlite:////x.db"
    for tiers, message in [
        ((disk, ram), "must be listed first"),
        ((ram,), "at least one storage tier"),
        ((TierConfig("ram", kind="memory"), disk), "needs quota_bytes"),
        ((TierConfig("nvme", quota_bytes=1, kind="memory"), disk), "unique"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(tiers=tiers, catalog_url=url)
    with pytest.raises(ValueError, match="at most one"):
        EngineConfig(tiers=(ram, disk), catalog_url=url, memory=ram)
