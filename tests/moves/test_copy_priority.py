"""A move copies its bytes on a thread of its own, at a lower CPU priority than the process,
so that on a busy host serving gets the cores first (``tierd bench serving`` measures it)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from tests.helpers import checksum, payload, put, tier_files
from tiering.engine import Engine
from tiering.errors import StorageError
from tiering.moves.concurrency import lower_priority


def _copying_thread(eng: Engine, relpath: str) -> tuple[str, int]:
    """Move ``relpath`` to ssd; the name and nice value of the thread that copied."""
    seen: list[tuple[str, int]] = []

    def hook(step: str) -> None:
        if step == "copying":
            tid = threading.get_native_id()
            seen.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid)))

    eng.mover.hook = hook
    try:
        rec = eng.lookup(relpath)
        eng.migrate(rec.id, "ssd")
    finally:
        eng.mover.hook = None
    (got,) = seen
    return got


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")
def test_the_copy_runs_on_a_nicer_thread_and_the_bytes_arrive(eng: Engine) -> None:
    data = payload(300_000)
    put(eng, "f.bin", data)
    eng.mover.chunk_size = 64 << 10
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    name, nice = _copying_thread(eng, "f.bin")
    assert name.startswith("tierd-copy-")
    assert nice == min(19, base + eng.mover.copy_nice) and nice > base
    rec = eng.lookup("f.bin")
    assert rec.tier == "ssd" and rec.checksum == checksum(data)
    # The caller's own thread kept its priority.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base


def test_copy_nice_zero_copies_in_the_moves_own_thread(eng: Engine) -> None:
    put(eng, "f.bin", payload(300_000))
    eng.mover.chunk_size = 64 << 10
    eng.mover.copy_nice = 0
    name, _ = _copying_thread(eng, "f.bin")
    assert name == threading.current_thread().name


def test_a_file_of_one_chunk_is_copied_in_the_moves_own_thread(eng: Engine) -> None:
    put(eng, "small.bin", payload(64 << 10))
    eng.mover.chunk_size = 64 << 10
    name, _ = _copying_thread(eng, "small.bin")
    assert name == threading.current_thread().name


def test_an_error_in_the_copy_thread_aborts_the_move_cleanly(
    eng: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = payload(300_000)
    rec = put(eng, "f.bin", data)
    eng.mover.chunk_size = 64 << 10
    real_write = os.write
    calls = {"n": 0}

    def failing_write(fd: int, buf: bytes | memoryview) -> int:
        if threading.current_thread().name.startswith("tierd-copy-"):
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError(5, "Input/output error")
        return real_write(fd, buf)

    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(StorageError):
        eng.migrate(rec.id, "ssd")
    monkeypatch.undo()
    after = eng.get(rec.id)
    assert after.tier == "nvme" and after.state == "stable"
    assert tier_files(eng) == {"f.bin": ["nvme"]}  # no temp left at the destination


def test_lower_priority_refuses_what_it_cannot_name() -> None:
    assert lower_priority(None, 10) is None
    assert lower_priority(threading.get_native_id(), 0) is None
