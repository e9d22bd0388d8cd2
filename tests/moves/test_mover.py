"""The migration protocol: happy paths (same and cross filesystem), readers during moves,
conflicts with deletes, pins and second moves, and name clashes."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest

from app.settings import Settings
from tests.helpers import assert_invariants, engine_settings, payload, put, tier_files
from tiering.catalog import FileState, MigrationPhase
from tiering.engine import Engine
from tiering.errors import AlreadyExists, Conflict, FileBusy, TierNotFound


def test_move_down_and_up_keeps_bytes_and_metadata(eng: Engine) -> None:
    data = payload(3 << 20)
    rec = put(eng, "models/a.bin", data)
    os.chmod(eng.tiers.get("nvme").root / "models/a.bin", 0o600)
    st0 = os.stat(eng.tiers.get("nvme").root / "models/a.bin")
    info = eng.migrate(rec.id, "hdd")
    assert info.record.phase == MigrationPhase.DONE
    assert info.record.bytes_copied == len(data)
    assert info.duration_s is not None
    moved = eng.get(rec.id)
    assert (moved.tier, moved.generation) == ("hdd", rec.generation + 1)
    st1 = os.stat(eng.tiers.get("hdd").root / "models/a.bin")
    assert st1.st_mtime_ns == st0.st_mtime_ns == moved.mtime_ns
    assert st1.st_mode & 0o777 == 0o600
    assert_invariants(eng, {"models/a.bin": data})
    eng.migrate(rec.id, "nvme")
    assert_invariants(eng, {"models/a.bin": data})
    # A scan after moves finds nothing to change.
    report = eng.scan(check=True)
    assert report.drift == 0 and not report.conflicts


def test_cross_filesystem_moves(tmp_path: Path, shm_dir: Path) -> None:
    settings = engine_settings(tmp_path / "data", shm=shm_dir)
    with Engine(settings.engine_config()) as eng:
        assert (
            os.stat(eng.tiers.get("nvme").root).st_dev != os.stat(eng.tiers.get("hdd").root).st_dev
        )
        files = {f"x/{i}.bin": payload(random.randint(0, 2 << 20)) for i in range(4)}
        files["empty"] = b""
        recs = {p: put(eng, p, d) for p, d in files.items()}
        for rec in recs.values():
            eng.migrate(rec.id, "hdd")
        assert_invariants(eng, files)
        assert all(eng.get(r.id).tier == "hdd" for r in recs.values())
        for rec in recs.values():
            eng.migrate(rec.id, "ssd")
        assert_invariants(eng, files)


def test_manual_move_errors_change_nothing(eng: Engine) -> None:
    rec = put(eng, "a", b"abc")
    with pytest.raises(Conflict):
        eng.migrate(rec.id, "nvme")
    with pytest.raises(TierNotFound):
        eng.migrate(rec.id, "tape")
    eng.pin(rec.id, "nvme")
    with pytest.raises(FileBusy, match="pinned to nvme"):
        eng.migrate(rec.id, "hdd")
    assert eng.get(rec.id).generation == rec.generation
    assert eng.migrations() == []
    assert_invariants(eng, {"a": b"abc"})


def test_delete_pin_and_second_move_during_a_move_are_refused(eng: Engine) -> None:
    data = payload(1 << 20)
    rec = put(eng, "busy.bin", data)
    other = put(eng, "other.bin", b"x")
    eng.mover.chunk_size = 64 << 10
    seen: dict[str, BaseException | None] = {}

    def during(step: str) -> None:
        if step != "copying":
            return
        for name, op in {
            "delete": lambda: eng.delete(rec.id),
            "pin": lambda: eng.pin(rec.id, "nvme"),
            "move": lambda: eng.migrate(rec.id, "ssd"),
            "overwrite": lambda: eng.begin_upload("busy.bin", overwrite=True),
        }.items():
            try:
                op()
                seen[name] = None
            except FileBusy as exc:
                seen[name] = exc
        # Pinning to the destination in flight is fine, and other files are not held.
        eng.pin(rec.id, "hdd")
        eng.delete(other.id)

    eng.mover.hook = during
    eng.migrate(rec.id, "hdd")
    eng.mover.hook = None
    assert all(isinstance(v, FileBusy) for v in seen.values()), seen
    assert set(seen) == {"delete", "pin", "move", "overwrite"}
    assert eng.get(rec.id).pinned_tier == "hdd"
    assert_invariants(eng, {"busy.bin": data})


def test_name_clash_at_destination_is_never_overwritten(eng: Engine) -> None:
    data = payload(100_000)
    rec = put(eng, "d/clash.bin", data)
    foreign = eng.tiers.get("hdd").root / "d/clash.bin"
    foreign.parent.mkdir(parents=True)
    foreign.write_bytes(b"someone else's file")
    with pytest.raises(AlreadyExists, match="nothing was overwritten"):
        eng.migrate(rec.id, "hdd")
    assert foreign.read_bytes() == b"someone else's file"
    assert (eng.tiers.get("nvme").root / "d/clash.bin").read_bytes() == data
    after = eng.get(rec.id)
    assert (after.tier, after.state) == ("nvme", FileState.QUARANTINED)
    assert "nothing was overwritten" in (after.detail or "")
    [m] = eng.migrations()
    assert m.record.phase == MigrationPhase.FAILED and "AlreadyExists" in (m.record.error or "")
    assert "<temp>" not in tier_files(eng)


def test_clash_appearing_during_the_copy(eng: Engine) -> None:
    data = payload(1 << 20)
    rec = put(eng, "late.bin", data)
    eng.mover.chunk_size = 64 << 10
    foreign = eng.tiers.get("ssd").root / "late.bin"

    def during(step: str) -> None:
        if step == "copying":
            foreign.write_bytes(b"late arrival")

    eng.mover.hook = during
    with pytest.raises(AlreadyExists):
        eng.migrate(rec.id, "ssd")
    eng.mover.hook = None
    assert foreign.read_bytes() == b"late arrival"
    assert (eng.tiers.get("nvme").root / "late.bin").read_bytes() == data
    assert eng.get(rec.id).state == FileState.QUARANTINED


def _reader(
    eng: Engine, files: dict[int, bytes], stop: threading.Event, errors: list[str], count: list[int]
) -> None:
    rng = random.Random(threading.get_ident())
    ids = list(files)
    while not stop.is_set():
        fid = rng.choice(ids)
        data = files[fid]
        start = rng.randrange(0, len(data))
        end = rng.randrange(start, len(data) + 1)
        try:
            content = eng.open_content(fid)
            got = b"".join(content.iter_range(start, end, chunk=rng.choice([4096, 65536])))
        except Exception as exc:  # any error at all is a failure
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        if got != data[start:end]:
            errors.append(f"wrong bytes for file {fid} [{start}:{end}]")
        count[0] += 1


def _back_and_forth(eng: Engine, moves: int, readers: int, size: int) -> None:
    eng.mover.chunk_size = 64 << 10
    files = {put(eng, f"r/{i}", payload(size + i)).id: b"" for i in range(3)}
    for fid in files:
        rec = eng.get(fid)
        files[fid] = (eng.tiers.get(rec.tier).root / rec.relpath).read_bytes()
    stop = threading.Event()
    errors: list[str] = []
    count = [0]
    threads = [
        threading.Thread(target=_reader, args=(eng, files, stop, errors, count), name=f"reader{i}")
        for i in range(readers)
    ]
    for t in threads:
        t.start()
    try:
        tiers = ["nvme", "ssd", "hdd"]
        for i in range(moves):
            fid = list(files)[i % len(files)]
            cur = eng.get(fid).tier
            eng.migrate(fid, random.choice([t for t in tiers if t != cur]))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert count[0] > 0
    assert_invariants(eng, {eng.get(fid).relpath: d for fid, d in files.items()})


def test_readers_during_back_and_forth_moves(eng: Engine) -> None:
    _back_and_forth(eng, moves=30, readers=3, size=300_000)


@pytest.mark.slow
def test_readers_during_many_moves_across_filesystems(tmp_path: Path, shm_dir: Path) -> None:
    settings: Settings = engine_settings(tmp_path / "data", shm=shm_dir)
    with Engine(settings.engine_config()) as eng:
        _back_and_forth(eng, moves=400, readers=4, size=2 << 20)
