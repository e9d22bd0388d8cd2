"""Each host reconciles only its own records. Two engines with their own host ids and tier
directories on one PostgreSQL catalog: host B's scan (and the watcher's per-path reconcile)
leaves host A's files as they are, even where B finds the same relpath or the same bytes on
its own disks; host A's scan still finds A's own drift."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.helpers import engine_settings, payload, put
from tiering.catalog import FileRecord, FileState
from tiering.engine import Engine
from tiering.sync import reconcile_paths


def _engines(tmp_path: Path, pg_url: str) -> tuple[Any, Any]:
    kw: dict[str, Any] = {"catalog_url": pg_url, "scan_on_start": False, "watch": False}
    a = engine_settings(tmp_path / "a", host_id="host-a", **kw)
    b = engine_settings(tmp_path / "b", host_id="host-b", **kw)
    return a, b


def _rows(eng: Engine) -> dict[str, tuple[Any, ...]]:
    def row(r: FileRecord) -> tuple[Any, ...]:
        return (r.id, r.tier, r.host, r.state, r.generation, r.size, r.checksum)

    return {r.relpath: row(r) for r in eng.catalog.all()}


def test_a_hosts_scan_leaves_other_hosts_files_alone(tmp_path: Path, pg_url: str) -> None:
    sa, sb = _engines(tmp_path, pg_url)
    with Engine(sa.engine_config()) as ea, Engine(sb.engine_config()) as eb:
        put(ea, "m/a.bin", payload(1000, 1))
        put(ea, "m/edit.bin", payload(500, 2), tier="ssd")
        put(ea, "m/gone.bin", payload(700, 3), tier="hdd")
        put(eb, "m/b.bin", payload(300, 4))
        # B finds on its own disk a relpath whose record is A's: reported, never adopted.
        (sb.data_dir / "hdd" / "m").mkdir(parents=True, exist_ok=True)
        (sb.data_dir / "hdd" / "m" / "a.bin").write_bytes(b"B's own bytes")
        before = _rows(ea)

        check = eb.scan(check=True)
        report = eb.scan()
        for r in (check, report):
            assert (r.missing, r.changed, r.moved, r.adopted) == ([], [], [], [])
            assert r.conflicts == {"m/a.bin": ["hdd", "nvme@host-a"]}
        assert reconcile_paths(eb.catalog, eb.tiers, list(before)).drift == 0
        assert _rows(ea) == before
        assert (sb.data_dir / "hdd" / "m" / "a.bin").read_bytes() == b"B's own bytes"

        # A's own drift is still A's to find.
        (sa.data_dir / "ssd" / "m" / "edit.bin").write_bytes(b"edited by hand")
        (sa.data_dir / "hdd" / "m" / "gone.bin").unlink()
        report = ea.scan()
        assert (report.changed, report.missing, report.conflicts) == (
            ["m/edit.bin"],
            ["m/gone.bin"],
            {},
        )
        assert ea.catalog.lookup("m/gone.bin").state == FileState.MISSING
        assert ea.catalog.lookup("m/edit.bin").size == len(b"edited by hand")
        assert ea.catalog.lookup("m/b.bin").state == FileState.STABLE  # B's, untouched


def test_the_same_bytes_on_another_host_are_not_a_rename(tmp_path: Path, pg_url: str) -> None:
    """A file that vanished on host A and a file with its bytes that appears on host B are two
    files: B adopts its own, and A's record stays A's (missing, for A to settle)."""
    sa, sb = _engines(tmp_path, pg_url)
    data = payload(4096, 5)
    with Engine(sa.engine_config()) as ea, Engine(sb.engine_config()) as eb:
        old = put(ea, "r/old.bin", data)
        os.unlink(sa.data_dir / "nvme" / "r" / "old.bin")
        assert ea.scan().missing == ["r/old.bin"]
        (sb.data_dir / "nvme" / "r").mkdir(parents=True)
        (sb.data_dir / "nvme" / "r" / "new.bin").write_bytes(data)
        report = eb.scan()
        assert (report.adopted, report.renamed) == (["r/new.bin"], [])
        gone = ea.catalog.lookup("r/old.bin")
        assert (gone.id, gone.host, gone.state) == (old.id, "host-a", FileState.MISSING)
        new = eb.catalog.lookup("r/new.bin")
        assert (new.host, new.tier) == ("host-b", "nvme") and new.id != old.id
