"""Symbolic links in a tier root are reported, never followed nor passed over in silence: a
copied Hugging Face cache (snapshots of links into ``blobs/``) says why its model files are not
adopted (issue 40)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers import engine_settings
from tiering.engine import Engine

REPO = "models--org--tiny"


def test_a_hugging_face_cache_layout_reports_its_links(tmp_path: Path) -> None:
    settings = engine_settings(tmp_path / "data")
    root = settings.data_dir / "ssd" / REPO
    (root / "blobs").mkdir(parents=True)
    (root / "snapshots" / "abc123").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("abc123")
    for name, blob, data in [
        ("config.json", "1f2e", b"{}"),
        ("model.safetensors", "9a8b", os.urandom(4096)),
    ]:
        (root / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", root / "snapshots" / "abc123" / name)
    with Engine(settings.engine_config()) as eng:
        report = eng.scan()
        links = [
            f"{REPO}/snapshots/abc123/config.json",
            f"{REPO}/snapshots/abc123/model.safetensors",
        ]
        assert sorted(report.skipped) == links
        for link in links:
            assert "symbolic link" in report.reasons[link] and "tier ssd" in report.reasons[link]
        # The regular files are adopted as they are (here by the engine's start); a link is
        # never a record.
        adopted = sorted(r.relpath for r in eng.catalog.all())
        assert adopted == [f"{REPO}/blobs/1f2e", f"{REPO}/blobs/9a8b", f"{REPO}/refs/main"]
        # A second scan reports them again (they are still there), and changes nothing.
        again = eng.scan()
        assert sorted(again.skipped) == links and not again.drift


def test_a_link_to_a_directory_outside_the_tier_is_reported_not_walked(tmp_path: Path) -> None:
    settings = engine_settings(tmp_path / "data")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"not tierd's")
    (settings.data_dir / "nvme").mkdir(parents=True)
    os.symlink(outside, settings.data_dir / "nvme" / "escape")
    with Engine(settings.engine_config()) as eng:
        report = eng.scan()
        assert report.skipped == ["escape"] and eng.catalog.all() == []
