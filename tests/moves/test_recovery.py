"""kill -9 at every step of the protocol (RELIABILITY.md row 1), lost un-synced writes at the
fsync points (row 2), orphan temps and stale intents (row 10), recovery run twice, across
filesystems (row 11). Each check reads the bytes back."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import pytest

from app.settings import Settings
from tests.conftest import disk_snapshot
from tests.helpers import assert_invariants, engine_settings, payload, put, tier_files
from tiering.catalog import FileState, MigrationPhase
from tiering.engine import Engine
from tiering.moves import STEPS

SIZE = 300_000  # several 64 KiB chunks, so "copying" is mid-copy


def _child(settings: Settings, file_id: int, dst: str, step: str) -> None:
    # Runs in a forked process: open (no threads), move, SIGKILL ourselves at ``step``.
    try:
        eng = Engine(settings.engine_config()).open()
        eng.mover.chunk_size = 64 << 10

        def hook(s: str) -> None:
            if s == step:
                os.kill(os.getpid(), signal.SIGKILL)

        eng.mover.hook = hook
        eng.migrate(file_id, dst)
    finally:
        os._exit(3)  # reached only if the step never came


def crash_move(settings: Settings, file_id: int, dst: str, step: str) -> None:
    # From a fork server, not a fork of this worker: the worker has threads (a moto server, other
    # tests' engines), and a fork while one of them held a lock hung a child once in ~8 runs.
    # The server is a fresh process of its own (one a worker, tierd imported in it once).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    p = ctx.Process(target=_child, args=(settings, file_id, dst, step))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL, f"child exit code {p.exitcode} at step {step}"


def _prepare(settings: Settings, n: int = 1) -> dict[str, bytes]:
    files = {f"d/f{i}.bin": payload(SIZE + i) for i in range(n)}
    with Engine(settings.engine_config()) as eng:
        for p, d in files.items():
            put(eng, p, d)
    return files


def _recover_and_check(settings: Settings, files: dict[str, bytes], want_tier: str) -> None:
    with Engine(settings.engine_config()) as eng:
        assert_invariants(eng, files)
        assert eng.catalog.lookup("d/f0.bin").tier == want_tier
        snap = disk_snapshot(settings.data_dir)
        second = eng.mover.recover()
        assert not second.changed
        assert disk_snapshot(settings.data_dir) == snap
        # The file moves again normally after recovery.
        rec = eng.catalog.lookup("d/f0.bin")
        eng.migrate(rec.id, "ssd")
        assert_invariants(eng, files)
    with Engine(settings.engine_config()) as eng:  # and a restart changes nothing
        assert eng.last_recovery is not None and not eng.last_recovery.changed
        assert_invariants(eng, files)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("fs", ["same", "cross"])
def test_kill_9_at_every_step(
    tmp_path: Path, step: str, fs: str, request: pytest.FixtureRequest
) -> None:
    shm = request.getfixturevalue("shm_dir") if fs == "cross" else None
    settings = engine_settings(tmp_path / "data", shm=shm)
    files = _prepare(settings)
    crash_move(settings, 1, "hdd", step)
    committed = STEPS.index(step) >= STEPS.index("switched")
    _recover_and_check(settings, files, "hdd" if committed else "nvme")


def _crashed_at(tmp_path: Path, step: str) -> tuple[Settings, dict[str, bytes], Path, Path]:
    settings = engine_settings(tmp_path / "data")
    files = _prepare(settings)
    crash_move(settings, 1, "hdd", step)
    src = settings.data_dir / "nvme" / "d/f0.bin"
    dst = settings.data_dir / "hdd" / "d/f0.bin"
    return settings, files, src, dst


def _temp(settings: Settings) -> Path:
    [t] = [p for p in (settings.data_dir / "hdd" / "d").iterdir() if p.name.endswith(".tierd-tmp")]
    return t


def test_lost_unsynced_temp_writes(tmp_path: Path) -> None:
    # Before the temp's fsync its pages may be lost: a short temp is just removed.
    settings, files, _src, _dst = _crashed_at(tmp_path, "copied")
    t = _temp(settings)
    os.truncate(t, 1000)
    _recover_and_check(settings, files, "nvme")


def test_crash_between_link_and_temp_unlink(tmp_path: Path) -> None:
    # Both names at B (link done, temp not yet unlinked): both go, the source stays.
    settings, files, _src, dst = _crashed_at(tmp_path, "verified")
    os.link(_temp(settings), dst)
    _recover_and_check(settings, files, "nvme")


def test_lost_source_unlink(tmp_path: Path) -> None:
    # The source unlink was not fsynced when the power went: the source comes back.
    settings, files, src, dst = _crashed_at(tmp_path, "source_unlinked")
    assert not src.exists()
    src.write_bytes(dst.read_bytes())
    _recover_and_check(settings, files, "hdd")


def test_copying_intent_with_the_source_lost_keeps_the_verified_copy(tmp_path: Path) -> None:
    settings, files, src, _dst = _crashed_at(tmp_path, "published")
    src.unlink()
    with Engine(settings.engine_config()) as eng:
        assert eng.last_recovery is not None and eng.last_recovery.relocated == [1]
    _recover_and_check(settings, files, "hdd")


def test_switched_intent_with_the_copy_lost_goes_back_to_the_source(tmp_path: Path) -> None:
    settings, files, _src, dst = _crashed_at(tmp_path, "switched")
    dst.unlink()
    with Engine(settings.engine_config()) as eng:
        assert eng.last_recovery is not None and eng.last_recovery.relocated == [1]
        [m] = eng.migrations()
        assert m.record.phase == MigrationPhase.FAILED and "lost" in (m.record.error or "")
    _recover_and_check(settings, files, "nvme")


@pytest.mark.parametrize("step", ["copied", "switched"])
def test_undecidable_state_is_quarantined_and_nothing_deleted(tmp_path: Path, step: str) -> None:
    settings, files, src, dst = _crashed_at(tmp_path, step)
    # Both sides wrong: the source changed out of band and the copy is damaged or absent.
    src.write_bytes(b"changed by someone")
    if dst.exists():
        dst.write_bytes(b"damaged")
    before = disk_snapshot(settings.data_dir)
    with Engine(
        settings.engine_config(),
    ) as eng:
        assert eng.last_recovery is not None and eng.last_recovery.quarantined == [1]
        rec = eng.catalog.lookup("d/f0.bin")
        # The scan after recovery may have adopted the changed source; either way, nothing
        # was deleted, and the migration says why it failed.
        [m] = eng.migrations()
        assert m.record.phase == MigrationPhase.FAILED
        assert "could not decide" in (m.record.error or "")
        assert rec.state in (FileState.QUARANTINED, FileState.CONFLICT, FileState.STABLE)
        after = disk_snapshot(settings.data_dir)
        assert set(before) <= set(after), "recovery deleted something"
        assert eng.mover.recover().changed is False


def test_orphan_temps_and_stale_intents(tmp_path: Path) -> None:
    settings = engine_settings(tmp_path / "data")
    files = _prepare(settings, n=3)
    crash_move(settings, 2, "ssd", "copying")  # leaves a stale intent and its temp
    root = settings.data_dir
    orphans = [root / "nvme" / ".w-0123.tierd-tmp", root / "hdd" / "x" / ".9.9.tierd-tmp"]
    orphans[1].parent.mkdir(parents=True)
    for o in orphans:
        o.write_bytes(b"partial")
    users = [root / "ssd" / "notes.tmp", root / "ssd" / ".hidden", root / "ssd" / "a.tierd-tmp.bak"]
    for u in users:
        u.write_bytes(b"user data")
    with Engine(settings.engine_config()) as eng:
        assert eng.last_recovery is not None and eng.last_recovery.aborted == [1]
        assert not any(o.exists() for o in orphans)
        assert all(u.read_bytes() == b"user data" for u in users)
        assert "<temp>" not in tier_files(eng)
        assert_invariants(eng, files)
        snap = disk_snapshot(root)
    with Engine(settings.engine_config()) as eng:
        assert not eng.last_recovery.changed  # type: ignore[union-attr]
        assert disk_snapshot(root) == snap
