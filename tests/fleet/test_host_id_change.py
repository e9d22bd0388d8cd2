"""On SQLite one tierd ever writes the catalog, so a new host id (a recreated container's new
hostname) takes over every local record and every open move of the old one at start: nothing
is left unscanned, unplanned or unrecovered."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import engine_settings, payload, put, tier_files
from tiering.catalog.journal import Journal
from tiering.engine import Engine


def test_a_new_host_id_on_sqlite_takes_over_records_and_intents(tmp_path: Path) -> None:
    old = engine_settings(tmp_path / "d", host_id="old-container")
    with Engine(old.engine_config()) as eng:
        a = put(eng, "a.bin", payload(1000, 1))
        b = put(eng, "b.bin", payload(1000, 2))
        assert eng.catalog.get(a.id).host == "old-container"
        # A move the old host claimed and never finished (as if killed -9 before its copy).
        intent, _ = Journal(eng.catalog.db, host="old-container").claim(b.id, "ssd", reason="t")
    new = engine_settings(tmp_path / "d", host_id="new-container")
    with Engine(new.engine_config()) as eng:
        assert {eng.catalog.get(r.id).host for r in (a, b)} == {"new-container"}
        # Recovery settled the old host's move: the file is stable, no intent is open.
        assert eng.journal.open_intents() == []
        assert eng.catalog.get(b.id).state == "stable"
        # The start's scan saw both files as this host's: no conflict, nothing missing.
        assert eng.last_scan is not None and not eng.last_scan.conflicts
        assert not eng.last_scan.missing
        assert tier_files(eng) == {"a.bin": ["nvme"], "b.bin": ["nvme"]}
        assert intent.host == "old-container"
