"""Settings and helpers of the memory tier's engine tests: a memory tier above three real
directory tiers, hot files, and what the catalog says about copies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.settings import Settings, get_settings
from tests.helpers import seeded
from tiering.catalog import CopyRow
from tiering.engine import Engine

MiB = 1 << 20


def memory_settings(root: Path, *, quota: int = 16 * MiB, **overrides: Any) -> Settings:
    """``ram`` (a memory tier of ``quota``) above nvme, ssd and hdd under ``root``. No floor
    (the CI host's free memory is not what these tests are about: test_pressure sets one)."""
    tiers = [
        {"name": "ram", "kind": "memory", "quota_bytes": quota},
        {"name": "nvme", "path": root / "nvme"},
        {"name": "ssd", "path": root / "ssd"},
        {"name": "hdd", "path": root / "hdd"},
    ]
    overrides.setdefault("access_flush_interval_s", 0.05)
    overrides.setdefault("memory_floor_bytes", 0)
    overrides.setdefault("host_id", "host-a")
    overrides.setdefault("watch", False)
    return seeded(get_settings(data_dir=root, tiers=tiers, **overrides))


def heat_up(engine: Engine, file_id: int, n: int = 1000) -> None:
    """Count ``n`` accesses of a file and write them to the catalog now."""
    assert engine.access is not None
    engine.access.record(file_id, n)
    engine.access.flush()


def copy_rows(engine: Engine) -> list[CopyRow]:
    assert engine.db is not None
    from tiering.catalog import Copies

    return Copies(engine.db).list()


def cached_ids(engine: Engine) -> list[int]:
    assert engine.memory is not None
    return sorted(e.file_id for e in engine.memory.entries())


def assert_catalog_never_names_memory(engine: Engine) -> None:
    """Every file lives on a storage tier, and every copy row is of such a file (a copy is
    never the only one)."""
    storage = {t.name for t in engine.tiers}
    records = {r.id: r for r in engine.catalog.all()}
    assert all(r.tier in storage for r in records.values()), records
    assert all(r.pinned_tier in (None, *storage) for r in records.values())
    for row in copy_rows(engine):
        rec = records[row.file_id]  # a row names a file the catalog has...
        on_disk = engine.tiers.get(rec.tier).stat(rec.relpath)
        assert on_disk is not None and on_disk.size == rec.size  # ...whose bytes are on disk
