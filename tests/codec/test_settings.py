"""The ``compression`` tier setting: parsed from TOML, carried to the tier, refused where it
cannot apply, and what ``auto`` means for the embedded default's tiers."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import get_settings
from tiering.tiers import DirectoryTier, Tiers


def test_toml_setting_reaches_the_tiers(tmp_path: Path) -> None:
    cfg = tmp_path / "tierd.toml"
    cfg.write_text(
        f'[[tiers]]\nname = "fast"\npath = "{tmp_path}/fast"\ncompression = "on"\n'
        f'[[tiers]]\nname = "slow"\npath = "{tmp_path}/slow"\ncompression = "off"\n'
        f'[[tiers]]\nname = "cold"\npath = "{tmp_path}/cold"\n'
    )
    config = get_settings(cfg).engine_config()
    assert [t.compression for t in config.tiers] == ["on", "off", "auto"]
    tiers = Tiers(config.tiers)
    try:
        got = {t.name: t.compresses for t in tiers if isinstance(t, DirectoryTier)}
        assert got == {"fast": True, "slow": False, "cold": True}
    finally:
        tiers.close()


def test_auto_compresses_only_the_default_hdd(tmp_path: Path) -> None:
    tiers = Tiers(get_settings(data_dir=tmp_path).engine_config().tiers)
    try:
        got = {t.name: t.compresses for t in tiers if isinstance(t, DirectoryTier)}
        assert got == {"nvme": False, "ssd": False, "hdd": True}
    finally:
        tiers.close()


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        ({"name": "ram", "kind": "memory", "quota_bytes": 1 << 20, "compression": "on"}, "is for"),
        ({"name": "d", "path": "/x", "compression": "zstd"}, "auto"),
    ],
)
def test_refused_where_it_cannot_apply(tmp_path: Path, tier: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        get_settings(data_dir=tmp_path, tiers=[tier, {"name": "z", "path": tmp_path}])
