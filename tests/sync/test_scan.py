"""Scan: adopting, changed, moved by hand, missing, conflicts, temp files, --check."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import make_settings
from tiering.catalog import Catalog, FileState
from tiering.checksum import Hasher
from tiering.engine import Engine
from tiering.sync.scan import scan
from tiering.tiers import DirectoryTier, Tier, WalkEntry


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def xxh(data: bytes) -> str:
    h = Hasher()
    h.update(data)
    return h.value()


def test_start_adopts_existing_files(settings, data_dir: Path) -> None:
    write(data_dir / "ssd/models/a.bin", b"aaa")
    write(data_dir / "hdd/b.bin", b"bb")
    write(data_dir / "hdd/.w-deadbeef.tierd-tmp", b"orphan")  # a crashed upload
    write(data_dir / "hdd/user.tierd-tmp.txt", b"user file, not ours")
    with Engine(settings.engine_config()) as eng:
        recs = {r.relpath: r for r in eng.catalog.all()}
        assert set(recs) == {"models/a.bin", "b.bin", "user.tierd-tmp.txt"}
        assert recs["models/a.bin"].tier == "ssd" and recs["models/a.bin"].checksum == xxh(b"aaa")
        assert recs["b.bin"].size == 2
        assert eng.last_scan is not None and len(eng.last_scan.adopted) == 3
    assert not (data_dir / "hdd/.w-deadbeef.tierd-tmp").exists()


def test_changed_moved_missing_and_back(engine: Engine, data_dir: Path) -> None:
    write(data_dir / "nvme/c.bin", b"v1")
    write(data_dir / "nvme/m.bin", b"moving")
    write(data_dir / "nvme/g.bin", b"gone")
    engine.scan()
    c0 = engine.lookup("c.bin")
    engine.access.record(c0.id, 5)
    engine.access.flush()

    write(data_dir / "nvme/c.bin", b"version 2")
    os.rename(data_dir / "nvme/m.bin", data_dir / "hdd/m.bin")
    (data_dir / "nvme/g.bin").unlink()

    check = engine.scan(check=True)
    assert (check.changed, check.moved, check.missing) == (["c.bin"], ["m.bin"], ["g.bin"])
    assert engine.lookup("c.bin").checksum == xxh(b"v1")  # --check changed nothing

    report = engine.scan()
    assert (report.changed, report.moved, report.missing) == (["c.bin"], ["m.bin"], ["g.bin"])
    c1 = engine.lookup("c.bin")
    assert c1.id == c0.id and c1.checksum == xxh(b"version 2") and c1.size == 9
    assert c1.access_count == 5  # heat and counts survive an outside edit
    assert engine.lookup("m.bin").tier == "hdd"
    assert engine.lookup("g.bin").state == FileState.MISSING

    write(data_dir / "ssd/g.bin", b"gone")
    engine.scan()
    assert engine.lookup("g.bin").state == FileState.STABLE
    assert engine.lookup("g.bin").tier == "ssd"
    assert engine.scan().drift == 0


def test_conflict_is_reported_and_nothing_deleted(engine: Engine, data_dir: Path) -> None:
    write(data_dir / "nvme/dup.bin", b"fast copy")
    write(data_dir / "hdd/dup.bin", b"slow copy")
    report = engine.scan()
    assert report.conflicts == {"dup.bin": ["nvme", "hdd"]}
    rec = engine.lookup("dup.bin")
    assert rec.state == FileState.CONFLICT and "nvme" in (rec.detail or "")
    assert (data_dir / "nvme/dup.bin").read_bytes() == b"fast copy"
    assert (data_dir / "hdd/dup.bin").read_bytes() == b"slow copy"
    (data_dir / "hdd/dup.bin").unlink()
    engine.scan()
    assert engine.lookup("dup.bin").state == FileState.STABLE


def test_symlinks_are_not_adopted(engine: Engine, data_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "outside.txt").write_bytes(b"secret")
    (data_dir / "nvme/link.txt").symlink_to(tmp_path / "outside.txt")
    (data_dir / "nvme/dirlink").symlink_to(tmp_path)
    engine.scan()
    assert engine.catalog.all() == []


def test_missing_files_are_hidden_from_listings(client, data_dir: Path) -> None:
    fid = client.put("/v1/files/content", params={"path": "x.bin"}, content=b"x").json()["id"]
    (data_dir / "nvme/x.bin").unlink()
    client.app.state.engine.scan()
    assert client.get("/v1/files").json()["items"] == []
    missing = client.get("/v1/files", params={"state": "missing"}).json()["items"]
    assert [f["id"] for f in missing] == [fid]
    assert client.get(f"/v1/files/{fid}/content").status_code == 404


def test_rename_is_recognised_by_content(engine: Engine, data_dir: Path) -> None:
    write(data_dir / "ssd/a.bin", b"weights v1")
    write(data_dir / "ssd/empty", b"")
    engine.scan()
    rec = engine.lookup("a.bin")
    empty = engine.lookup("empty")
    engine.access.record(rec.id, 3)
    engine.access.flush()
    (data_dir / "ssd/new/dir").mkdir(parents=True)
    os.rename(data_dir / "ssd/a.bin", data_dir / "ssd/new/dir/a.bin")
    os.rename(data_dir / "ssd/empty", data_dir / "ssd/empty2")
    report = engine.scan()
    assert report.renamed == [("a.bin", "new/dir/a.bin")]
    moved = engine.lookup("new/dir/a.bin")
    assert moved.id == rec.id and moved.access_count == 3
    # Empty files all look alike, so they are never matched: a new record, the old one missing.
    assert engine.lookup("empty2").id != empty.id
    assert engine.lookup("empty").state == FileState.MISSING


def test_rename_seen_in_two_passes_keeps_identity(engine: Engine, data_dir: Path) -> None:
    write(data_dir / "hdd/old.bin", b"payload")
    engine.scan()
    rec = engine.lookup("old.bin")
    # Pass 1 sees only the disappearance; pass 2 the new name.
    os.rename(data_dir / "hdd/old.bin", data_dir / "old.bin.outside")
    engine.scan()
    assert engine.lookup("old.bin").state == FileState.MISSING
    os.rename(data_dir / "old.bin.outside", data_dir / "hdd/renamed.bin")
    engine.scan()
    assert engine.lookup("renamed.bin").id == rec.id
    assert engine.catalog.find("old.bin") is None
    # The other order: the copy is adopted first, then the original vanishes.
    write(data_dir / "hdd/x.bin", b"other payload")
    engine.scan()
    x = engine.lookup("x.bin")
    write(data_dir / "hdd/y.bin", b"other payload")
    engine.scan()
    (data_dir / "hdd/x.bin").unlink()
    report = engine.scan()
    assert report.renamed == [("x.bin", "y.bin")] and report.missing == []
    assert engine.lookup("y.bin").id == x.id and engine.catalog.find("x.bin") is None


def test_identical_copies_are_not_renames(engine: Engine, data_dir: Path) -> None:
    write(data_dir / "ssd/a.bin", b"same")
    engine.scan()
    a = engine.lookup("a.bin")
    write(data_dir / "ssd/b.bin", b"same")
    engine.scan()
    assert engine.lookup("a.bin").id == a.id and engine.lookup("b.bin").id != a.id


def test_scan_over_rest_and_cli_refuses_beside_a_server(data_dir: Path) -> None:
    from typer.testing import CliRunner

    from app.cli import cli
    from tests.conftest import LiveServer, make_settings

    # No watcher: this test is about the explicit scan, not about live sync.
    with LiveServer(make_settings(data_dir, watch=False)) as srv, srv.client() as c:
        write(data_dir / "hdd/late.bin", b"late")
        r = c.post("/v1/scan", params={"check": "true"})
        assert r.status_code == 200 and r.json()["adopted"] == ["late.bin"]
        assert c.get("/v1/files/lookup", params={"path": "late.bin"}).status_code == 404
        # The CLI would be a second writer beside the server: it refuses and says what to use.
        result = CliRunner().invoke(cli, ["scan", "--data-dir", str(data_dir)])
        assert result.exit_code == 1 and "POST /v1/scan" in result.output
        check = CliRunner().invoke(cli, ["scan", "--check", "--data-dir", str(data_dir)])
        assert check.exit_code == 1  # reading beside a server is fine; it reports the drift
        r = c.post("/v1/scan")
        assert r.status_code == 200 and r.json()["adopted"] == ["late.bin"]
        assert c.get("/v1/files/lookup", params={"path": "late.bin"}).json()["tier"] == "hdd"


class _Watched(DirectoryTier):
    """A real directory tier that notes, as its walk gives each file, how many files it gave
    that the catalog does not record yet: what the scan holds undecided."""

    def __init__(self, tier: Tier, catalog: Catalog) -> None:
        super().__init__(tier.config, tier.rank)
        self.catalog = catalog
        self.given = 0
        self.undecided: list[int] = []

    def walk(self) -> Iterator[WalkEntry]:
        base = self.catalog.count()
        for entry in super().walk():
            self.undecided.append(self.given - (self.catalog.count() - base))
            self.given += 1
            yield entry


def test_scan_streams_the_walk_and_holds_at_most_a_batch(data_dir: Path) -> None:
    """A bucket of a million objects scans in bounded memory: the walk is consumed as it
    comes and decisions are applied a batch at a time, never after the whole listing."""
    batch, n = 8, 120
    with Engine(make_settings(data_dir, watch=False).engine_config()) as eng:
        for i in range(n):
            write(data_dir / f"nvme/d{i % 7}/f{i:03}.bin", f"file {i}".encode())
        tier = _Watched(eng.tiers.get("nvme"), eng.catalog)
        report = scan(eng.catalog, [tier], batch=batch)
        assert len(report.adopted) == n == tier.given and eng.catalog.count() == n
        assert max(tier.undecided) <= 2 * batch, tier.undecided

        # Renames whose halves fall in different batches keep their records all the same:
        # those of d0 go after their old names in relpath order, those of d1 before.
        later = {f"d0/f{i:03}.bin": f"z/f{i:03}.bin" for i in range(0, n, 7)}
        earlier = {f"d1/f{i:03}.bin": f"0/f{i:03}.bin" for i in range(1, n, 7)}
        renames = later | earlier
        ids = {old: eng.lookup(old).id for old in renames}
        for old, new in renames.items():
            write(data_dir / "nvme" / new, b"")
            os.replace(data_dir / "nvme" / old, data_dir / "nvme" / new)
        report = scan(eng.catalog, [tier], batch=2)
        assert sorted(report.renamed) == sorted(renames.items())
        assert not report.missing and not report.adopted
        assert all(eng.lookup(new).id == ids[old] for old, new in renames.items())
