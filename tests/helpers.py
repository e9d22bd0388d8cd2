"""Helpers for the engine's tests: three real tiers in temp dirs (one on /dev/shm for
cross-filesystem moves), uploads, payloads, and the invariants of RELIABILITY.md checked
against the bytes on disk."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from app.settings import Settings, get_settings
from tiering.catalog import FileRecord, FileState, MigrationPhase
from tiering.catalog.backends import sqlite_file
from tiering.catalog.db import upgrade
from tiering.checksum import Hasher
from tiering.engine import Engine
from tiering.tiers.paths import is_temp_name, packed_relpath

SHM = Path("/dev/shm")


def engine_settings(
    root: Path, *, shm: Path | None = None, compression: str = "off", **overrides: Any
) -> Settings:
    """Three tiers under ``root``; with ``shm``, the slowest tier is on another filesystem.

    ``compression`` is the hdd tier's: off by default, so the tests of moves, faults and
    crashes see the bytes they wrote on every tier (``tests/codec`` covers compressed ones).
    """
    tiers = [
        {"name": "nvme", "path": root / "nvme"},
        {"name": "ssd", "path": root / "ssd"},
        {
            "name": "hdd",
            "path": (shm if shm is not None else root) / "hdd",
            "compression": compression,
        },
    ]
    overrides.setdefault("access_flush_interval_s", 0.05)
    overrides.setdefault("busy_timeout_ms", 5000)
    settings = get_settings(data_dir=root, tiers=tiers, **overrides)
    return seeded(settings)


@functools.cache
def _migrated_catalog() -> bytes:
    """An empty SQLite catalog that Alembic brought to head with tierd's migrations, built once
    per test process: the schema is the same for every test, and building it (every migration,
    several of them SQLite's table rebuilds) took 40 ms of CPU at each of ~800 engine starts."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "catalog.db"
        upgrade(f"sqlite:///{path}")
        return path.read_bytes()


def seeded(settings: Settings) -> Settings:
    """``settings``, its new SQLite catalog written as a copy of :func:`_migrated_catalog`: the
    engine's own upgrade at open finds it at head. tests/catalog/test_migrations.py builds
    catalogs from nothing, revision by revision, and tierd's own start-ups in subprocesses
    (tests/fleet, the CLI's tests) upgrade theirs."""
    path = sqlite_file(settings.catalog_url)
    # Only in pytest's temp directories: settings built for their document alone (the contract
    # test's, under a made-up root) make no catalog anywhere.
    in_tmp = path is not None and any(p.startswith("pytest-of-") for p in path.parts)
    if path is not None and in_tmp and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_migrated_catalog())
    return settings


def put(engine: Engine, relpath: str, data: bytes, tier: str = "nvme") -> FileRecord:
    with engine.begin_upload(relpath, tier=tier) as up:
        up.write(data)
        return up.commit()


def payload(n: int, seed: int = 0) -> bytes:
    """Deterministic, non-repeating bytes (so a misplaced chunk changes the hash)."""
    return (seed.to_bytes(4, "little") * ((n // 4) + 1))[:n] if n < 64 else os.urandom(n)


def checksum(data: bytes) -> str:
    h = Hasher()
    h.update(data)
    return h.value()


def tier_files(engine: Engine) -> dict[str, list[str]]:
    """relpath -> tiers holding it; temps (temp files, unfinished multipart uploads) under the
    key ``"<temp>"``. Through the tier interface, so it sees every backend alike."""
    out: dict[str, list[str]] = {}
    for tier in engine.tiers:
        root = tier.watch_root()
        if root is not None:
            # A directory is walked raw: anything at all left there must show up.
            for dirpath, _dirs, files in os.walk(root):
                for name in files:
                    rel = os.path.relpath(os.path.join(dirpath, name), root)
                    # A container is its relpath's file, at the tier's compressed place.
                    key = "<temp>" if is_temp_name(name) else packed_relpath(rel) or rel
                    out.setdefault(key, []).append(
                        tier.name if key != "<temp>" else f"{tier.name}:{rel}"
                    )
            continue
        for entry in tier.walk():
            out.setdefault(entry.relpath, []).append(tier.name)
        for rel, _stem in tier.temps():
            out.setdefault("<temp>", []).append(f"{tier.name}:{rel}")
    return out


def assert_invariants(engine: Engine, expected: dict[str, bytes], *, idle: bool = True) -> None:
    """Every expected file: one record, stable, on exactly one tier, with the right bytes and
    checksum; no temp files; no open intents (when idle)."""
    placed = tier_files(engine)
    assert "<temp>" not in placed, f"temp files left: {placed['<temp>']}"
    for relpath, data in expected.items():
        rec = engine.catalog.lookup(relpath)
        assert rec.state == FileState.STABLE, (relpath, rec.state, rec.detail)
        assert placed.get(relpath) == [rec.tier], (relpath, placed.get(relpath), rec.tier)
        on_disk = engine.tiers.get(rec.tier).read_bytes(relpath)
        assert on_disk == data, f"{relpath}: wrong bytes on {rec.tier}"
        assert rec.checksum == checksum(data)
        assert rec.size == len(data)
    if idle:
        assert engine.journal.list(phases=list(MigrationPhase.OPEN)) == []


def cli_text(output: str) -> str:
    """A CLI's output as one line of words: rich's error panel wraps at the terminal's width
    (80 columns by default) and draws a border on each line, so a message may be cut by
    ``│`` and line breaks anywhere; tests look for words, whatever the width."""
    return " ".join(output.replace("│", " ").split())


def chromium() -> tuple[Any, str, str]:
    """selenium, the chromium binary and chromedriver, or a skip saying which is missing (the
    browser tests: the dashboard's, and a web page's against a tokenless tierd)."""
    import pytest

    try:
        import selenium.webdriver as webdriver
    except ImportError:
        pytest.skip("selenium is not installed (pip install selenium)")
    chrome = next(
        (p for n in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(n))),
        None,
    )
    if chrome is None:
        pytest.skip("no chromium binary (Debian: apt-get install chromium)")
    driver = shutil.which("chromedriver")
    if driver is None:
        pytest.skip("no chromedriver (Debian: apt-get install chromium-driver)")
    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        pytest.skip("/dev/shm is not writable here (the cpu lease needs it)")
    return webdriver, chrome, driver


def chromium_options(webdriver: Any, chrome: str, profile: Path, *extra: str) -> Any:
    """Headless Chromium's options for the tests: no network of its own, a fresh profile."""
    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        *extra,
    ):
        opts.add_argument(arg)
    return opts
