"""Faults during a move (RELIABILITY.md rows 3-6 and 12): each must abort cleanly, leave the
source authoritative and untouched, leave nothing at the destination, and say what happened."""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_invariants, engine_settings, payload, put, tier_files
from tiering.catalog import FileState, MigrationPhase
from tiering.engine import Engine
from tiering.errors import CatalogBusy, FileBusy, InsufficientSpace, IntegrityError, StorageError


def fail_nth(
    real: Callable[..., Any], n: int, err: int, when: Callable[..., bool] = lambda *a, **k: True
) -> Callable[..., Any]:
    """Wrap an ``os`` function to raise ``OSError(err)`` on its n-th matching call."""
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if when(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                raise OSError(err, os.strerror(err))
        return real(*args, **kwargs)

    wrapper.calls = calls  # type: ignore[attr-defined]
    return wrapper


def _setup(eng: Engine, size: int = 1 << 20) -> tuple[int, bytes]:
    eng.mover.chunk_size = 64 << 10
    data = payload(size)
    return put(eng, "f/data.bin", data).id, data


def _assert_aborted(
    eng: Engine, fid: int, data: bytes, error_part: str, state: str = FileState.STABLE
) -> None:
    rec = eng.get(fid)
    assert rec.tier == "nvme" and rec.state == state, (rec.tier, rec.state, rec.detail)
    assert (eng.tiers.get("nvme").root / "f/data.bin").read_bytes() == data
    placed = tier_files(eng)
    assert placed.get("f/data.bin") == ["nvme"] and "<temp>" not in placed, placed
    [m] = eng.migrations()
    assert m.record.phase in (MigrationPhase.ABORTED, MigrationPhase.FAILED)
    assert error_part in (m.record.error or ""), m.record.error
    assert m.record.finished_at is not None


def test_enospc_mid_copy_patched_write(eng: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    fid, data = _setup(eng)
    monkeypatch.setattr(os, "write", fail_nth(os.write, 5, errno.ENOSPC))
    with pytest.raises(InsufficientSpace):
        eng.migrate(fid, "hdd")
    monkeypatch.undo()
    _assert_aborted(eng, fid, data, "InsufficientSpace")
    eng.migrate(fid, "hdd")  # and it works once there is room again
    assert_invariants(eng, {"f/data.bin": data})


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_enospc_on_a_real_tiny_tmpfs(tmp_path: Path, tiny_tmpfs: Path) -> None:
    settings = engine_settings(tmp_path / "data", shm=tiny_tmpfs)
    with Engine(settings.engine_config()) as eng:
        # Say there is room (the check passed, then something else filled the disk).
        eng.mover.room = lambda tier: 1 << 40
        fid, data = _setup(eng, size=3 << 20)
        with pytest.raises(InsufficientSpace):
            eng.migrate(fid, "hdd")
        _assert_aborted(eng, fid, data, "InsufficientSpace")
        # Without the pretence the free-space check refuses before writing anything.
        eng.mover.room = lambda tier: eng._room(tier, replacing=None)
        with pytest.raises(InsufficientSpace, match="has room for"):
            eng.migrate(fid, "hdd")
        assert os.listdir(tiny_tmpfs / "hdd") in ([], ["f"])


def test_eio_reading_the_source(eng: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    fid, data = _setup(eng)
    monkeypatch.setattr(os, "preadv", fail_nth(os.preadv, 3, errno.EIO))
    with pytest.raises(StorageError, match="Input/output error"):
        eng.migrate(fid, "ssd")
    monkeypatch.undo()
    _assert_aborted(eng, fid, data, "StorageError")


def test_failed_fsync_discards_the_copy_and_is_never_retried(
    eng: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    fid, data = _setup(eng)
    real = os.fsync
    calls: list[int] = []

    def fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:  # the temp file's fsync
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StorageError):
        eng.migrate(fid, "ssd")
    monkeypatch.undo()
    assert len([c for c in calls if c == calls[0]]) == 1
    _assert_aborted(eng, fid, data, "StorageError")


def test_eio_on_the_directory_fsync_after_link_removes_the_published_copy(
    eng: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    fid, data = _setup(eng)
    real = os.fsync
    count = [0]

    def fsync(fd: int) -> None:
        count[0] += 1
        if count[0] == 2:  # temp fsync is 1, destination directory fsync after link is 2
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StorageError):
        eng.migrate(fid, "ssd")
    monkeypatch.undo()
    _assert_aborted(eng, fid, data, "StorageError")


@pytest.mark.parametrize("err", [errno.EACCES, errno.EROFS])
def test_destination_refuses_writes(eng: Engine, monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    fid, data = _setup(eng)
    creat = lambda path, flags, *a, **k: bool(flags & os.O_CREAT)  # noqa: E731
    monkeypatch.setattr(os, "open", fail_nth(os.open, 1, err, creat))
    with pytest.raises(StorageError, match=os.strerror(err)):
        eng.migrate(fid, "hdd")
    monkeypatch.undo()
    _assert_aborted(eng, fid, data, "StorageError")


@pytest.mark.parametrize("change", ["append", "truncate", "replace", "remove", "touch"])
def test_source_changed_during_the_copy(eng: Engine, change: str) -> None:
    fid, data = _setup(eng)
    src = eng.tiers.get("nvme").root / "f/data.bin"
    new = b"new content"

    def during(step: str) -> None:
        if step != "copying":
            return
        if change == "append":
            with open(src, "ab") as f:
                f.write(b"more")
        elif change == "truncate":
            os.truncate(src, 1000)
        elif change == "replace":
            tmp = src.with_name("x.part")
            tmp.write_bytes(new)
            os.replace(tmp, src)
        elif change == "remove":
            src.unlink()
        elif change == "touch":
            os.utime(src, ns=(1, 1))

    eng.mover.hook = during
    with pytest.raises(FileBusy, match="changed, replaced or removed"):
        eng.migrate(fid, "hdd")
    eng.mover.hook = None
    rec = eng.get(fid)
    assert rec.tier == "nvme" and rec.state == FileState.QUARANTINED
    assert not (eng.tiers.get("hdd").root / "f/data.bin").exists()
    assert "<temp>" not in tier_files(eng)
    # The source was left alone: whatever the change made is still there.
    if change == "append":
        assert src.read_bytes() == data + b"more"
    elif change == "replace":
        assert src.read_bytes() == new
    elif change == "remove":
        assert not src.exists()
    # A scan adopts the changed content and makes the file movable again.
    if change != "remove":
        eng.scan()
        assert eng.get(fid).state == FileState.STABLE
        eng.migrate(fid, "hdd")


def test_source_not_matching_its_checksum_is_flagged(eng: Engine) -> None:
    fid, data = _setup(eng)
    src = eng.tiers.get("nvme").root / "f/data.bin"
    st = os.stat(src)
    with open(src, "r+b") as f:  # bit rot: same size, mtime put back
        f.write(b"\xff" * 16)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(IntegrityError, match="does not match its catalog checksum"):
        eng.migrate(fid, "ssd")
    rec = eng.get(fid)
    assert rec.state == FileState.QUARANTINED and rec.tier == "nvme"
    assert not (eng.tiers.get("ssd").root / "f/data.bin").exists()
    assert "<temp>" not in tier_files(eng)


def test_catalog_busy_at_claim_changes_nothing(tmp_path: Path) -> None:
    settings = engine_settings(tmp_path / "data", busy_timeout_ms=200)
    with Engine(settings.engine_config()) as eng:
        fid, data = _setup(eng)
        other = sqlite3.connect(str(tmp_path / "data" / "catalog.db"), isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(CatalogBusy):
                eng.migrate(fid, "hdd")
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert eng.migrations() == []
        assert_invariants(eng, {"f/data.bin": data})


def test_catalog_busy_at_the_switch_deletes_nothing_it_should_not(tmp_path: Path) -> None:
    """The commit point times out: the move is undone (B's copy removed, source kept), and
    the abort is recorded once the catalog frees up."""
    settings = engine_settings(tmp_path / "data", busy_timeout_ms=300)
    with Engine(settings.engine_config()) as eng:
        fid, data = _setup(eng)
        other = sqlite3.connect(
            str(tmp_path / "data" / "catalog.db"), isolation_level=None, check_same_thread=False
        )
        released = threading.Event()

        def hook(step: str) -> None:
            if step == "published":
                other.execute("BEGIN IMMEDIATE")

                def release() -> None:
                    time.sleep(0.5)
                    other.execute("ROLLBACK")
                    released.set()

                threading.Thread(target=release, name="release-lock").start()

        eng.mover.hook = hook
        with pytest.raises(CatalogBusy):
            eng.migrate(fid, "hdd")
        eng.mover.hook = None
        released.wait(5)
        other.close()
        _assert_aborted(eng, fid, data, "CatalogBusy")
        assert_invariants(eng, {"f/data.bin": data})
