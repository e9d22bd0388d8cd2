"""Settings: defaults, TOML file, environment and flags, strongest last."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import get_settings


def test_embedded_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = get_settings()
    assert s.host == "127.0.0.1" and s.port == 8470
    assert [t.name for t in s.tiers] == ["nvme", "ssd", "hdd"]
    assert s.tiers[0].path == tmp_path / "tierd-data" / "nvme"
    assert s.catalog_url == f"sqlite:///{tmp_path / 'tierd-data' / 'catalog.db'}"
    moved = get_settings(data_dir=tmp_path / "else")
    assert moved.tiers[2].path == tmp_path / "else" / "hdd"
    assert moved.catalog_url.endswith("/else/catalog.db")


def test_precedence_toml_env_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "tierd.toml"
    cfg.write_text(
        'port = 9000\nhost = "127.0.0.2"\nhalf_life_s = 60\n'
        '[[tiers]]\nname = "fast"\npath = "/mnt/fast"\nquota_bytes = 1000\n'
        '[[tiers]]\nname = "slow"\npath = "/mnt/slow"\n'
    )
    s = get_settings(cfg)
    assert (s.port, s.host, s.half_life_s) == (9000, "127.0.0.2", 60)
    assert [(t.name, str(t.path), t.quota_bytes) for t in s.tiers] == [
        ("fast", "/mnt/fast", 1000),
        ("slow", "/mnt/slow", None),
    ]
    monkeypatch.setenv("TIERD_PORT", "9100")
    monkeypatch.setenv("TIERD_CONFIG", str(cfg))
    s = get_settings()
    assert s.port == 9100 and s.host == "127.0.0.2"
    assert get_settings(port=9200).port == 9200
    monkeypatch.setenv("TIERD_TIERS", '[{"name": "only", "path": "/x"}]')
    assert [t.name for t in get_settings().tiers] == ["only"]


@pytest.mark.parametrize(
    "bad",
    [
        {"port": 70000},
        {"half_life_s": 0},
        {"tiers": [{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}]},
        {"tiers": [{"name": "Bad Name", "path": "/a"}]},
        {"default_tier": "nope"},
        {"unknown_setting": 1},
        {"io": {"remote_backend": "curl"}},
        {"io": {"remote_url_threads": 0}},
        {"io": {"remote_url_task_size": 4096}},
        {"fleet_tracker_polls": 0},
    ],
)
def test_invalid_settings(bad: dict) -> None:
    with pytest.raises(ValidationError):
        get_settings(**bad)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        get_settings(tmp_path / "nope.toml")


def test_the_remote_read_engine_is_set_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TIERD_IO__*: the engine, connections and GET size of loads by URL reach the loader."""
    from tiering.io import GdsConfig

    default = get_settings().buffers.loader_config(get_settings().io.gds_config()).io
    assert default == GdsConfig()  # unset: the library's own defaults
    monkeypatch.setenv("TIERD_IO__REMOTE_BACKEND", "sockets")
    monkeypatch.setenv("TIERD_IO__REMOTE_URL_THREADS", "64")
    monkeypatch.setenv("TIERD_IO__REMOTE_URL_TASK_SIZE", str(16 << 20))
    s = get_settings()
    io = s.buffers.loader_config(s.io.gds_config()).io
    assert (io.remote_backend, io.remote_url_threads, io.remote_url_task_size) == (
        "sockets", 64, 16 << 20,
    )  # fmt: skip


def test_the_fleet_poll_budget_reaches_the_fills(monkeypatch: pytest.MonkeyPatch) -> None:
    """TIERD_FLEET_TRACKER_POLLS: the fleet's polls a second, handed to the engine's fills."""
    assert get_settings().engine_config().tracker_polls == 2000.0
    monkeypatch.setenv("TIERD_FLEET_TRACKER_POLLS", "3500")
    assert get_settings().engine_config().tracker_polls == 3500.0
