"""A move's bytes are copied outside the serving process (issue 43): files of at least
``process_min`` bytes, local at both ends, go through the copy process
(:mod:`tiering.moves._copyproc`), one chunk at a time at the server's request, and the server's
steps (pacing, rests, verify, publish, switch) stay as they were. These tests prove where the
copy runs and that its failures abort cleanly; ``tierd bench serving`` measures what it gives.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from app.settings import Settings
from tests.helpers import assert_invariants, checksum, engine_settings, payload, put, tier_files
from tiering.engine import Engine
from tiering.errors import StorageError

CHUNK = 64 << 10
SIZE = 5 * CHUNK - 1000  # five chunks, the last one short


@pytest.fixture
def outside(eng: Engine) -> Engine:
    eng.mover.chunk_size = CHUNK
    eng.mover.settings.process_min = CHUNK  # small files, so the test stays cheap
    eng.mover.settings.process_chunk = CHUNK
    return eng


def _open_files(pid: int) -> list[tuple[str, int]]:
    """Where process ``pid``'s descriptors point, and each one's open flags."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/fdinfo/{fd}") as f:  # closed?
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            flags = next(line for line in f if line.startswith("flags:"))
            out.append((target, int(flags.split()[1], 8)))
    return out


def _flags(pid: int, suffix: str) -> list[int]:
    """The open flags of ``pid``'s descriptors of files whose path ends with ``suffix``."""
    return [flags for target, flags in _open_files(pid) if target.endswith(suffix)]


def _migrate_seeing(eng: Engine, file_id: int, tier: str, see: Callable[[], None]) -> None:
    """Move ``file_id`` to ``tier``, calling ``see()`` mid-copy (after its last chunk was
    copied, while the copy process still holds both files open)."""

    def hook(step: str) -> None:
        if step == "copying":
            see()

    eng.mover.hook = hook
    try:
        eng.migrate(file_id, tier)
    finally:
        eng.mover.hook = None


def test_the_bytes_are_copied_by_another_process_and_arrive(outside: Engine) -> None:
    data = payload(SIZE)
    put(outside, "f.bin", data)
    seen: list[tuple[int | None, set[str]]] = []
    process = outside.mover.copy_process

    def see() -> None:  # the process holds the temp file open, the server asks
        pid = process.pid
        seen.append((pid, {t for t, _ in _open_files(pid)} if pid else set()))

    _migrate_seeing(outside, outside.lookup("f.bin").id, "ssd", see)
    [(pid, fds)] = seen
    assert pid is not None and pid != os.getpid()
    assert any(".tierd-tmp" in target for target in fds), fds  # it writes the temp itself
    assert os.getpriority(os.PRIO_PROCESS, pid) > os.getpriority(os.PRIO_PROCESS, 0)
    rec = outside.lookup("f.bin")
    assert rec.tier == "ssd" and rec.checksum == checksum(data)
    assert tier_files(outside) == {"f.bin": ["ssd"]}


def test_a_move_still_yields_to_serving_one_chunk_at_a_time(outside: Engine) -> None:
    """The process copies only when the server asks, so the server's rests bound the work
    done while a request is served: one rest per chunk, as for a copy in the server."""
    gate = outside.mover.gate
    gate.active_s = 3600.0  # a request counts as in flight for an hour: no timing involved
    put(outside, "moving.bin", payload(SIZE))
    put(outside, "served.bin", b"s" * 8192)

    def see() -> None:
        outside.open_content(outside.lookup("served.bin").id).close()

    _migrate_seeing(outside, outside.lookup("moving.bin").id, "ssd", see)
    assert gate.rests == 5 + 1  # one per chunk, one for the other steps
    assert outside.mover.copy_process.starts == 1


def test_small_files_are_copied_in_the_server(outside: Engine) -> None:
    put(outside, "small.bin", payload(CHUNK - 1))
    outside.migrate(outside.lookup("small.bin").id, "ssd")
    assert outside.mover.copy_process.starts == 0


def test_a_killed_copy_process_fails_the_move_cleanly_and_the_next_starts_another(
    outside: Engine,
) -> None:
    data = payload(SIZE)
    rec = put(outside, "f.bin", data)
    process = outside.mover.copy_process

    def see() -> None:
        if process.pid is not None:
            os.kill(process.pid, signal.SIGKILL)

    with pytest.raises(StorageError, match="copy process"):
        _migrate_seeing(outside, rec.id, "ssd", see)
    after = outside.get(rec.id)
    assert after.tier == "nvme" and after.state == "stable"
    assert tier_files(outside) == {"f.bin": ["nvme"]}  # no temp left at the destination
    outside.migrate(rec.id, "ssd")
    assert outside.get(rec.id).checksum == checksum(data)
    assert process.starts == 2


def test_the_engine_stops_its_copy_process(outside: Engine) -> None:
    put(outside, "f.bin", payload(SIZE))
    outside.migrate(outside.lookup("f.bin").id, "ssd")
    process = outside.mover.copy_process
    pid = process.pid
    assert pid is not None
    outside.mover.close()
    assert process.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone, and reaped


def _child(settings: Settings, file_id: int, step: str, pid_file: Path) -> None:
    # A forked process: move through the copy process, write its pid, SIGKILL ourselves.
    try:
        eng = Engine(settings.engine_config()).open()
        eng.mover.chunk_size = CHUNK
        eng.mover.settings.process_min = eng.mover.settings.process_chunk = CHUNK

        def hook(s: str) -> None:
            if s == step:
                pid_file.write_text(str(eng.mover.copy_process.pid))
                os.kill(os.getpid(), signal.SIGKILL)

        eng.mover.hook = hook
        eng.migrate(file_id, "hdd")
    finally:
        os._exit(3)  # reached only if the step never came


def _gone(pid: int) -> bool:
    """Whether ``pid`` exited (a zombie whose new parent has not reaped it yet counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("step", ["copying", "copied"])
def test_kill_9_of_the_server_mid_copy_ends_the_copy_process_and_recovery_keeps_the_source(
    tmp_path: Path, step: str
) -> None:
    settings = engine_settings(tmp_path / "data")
    data = payload(SIZE)
    with Engine(settings.engine_config()) as eng:
        put(eng, "d/f.bin", data)
    pid_file = tmp_path / "copy.pid"
    p = multiprocessing.get_context("fork").Process(
        target=_child, args=(settings, 1, step, pid_file)
    )
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    copier = int(pid_file.read_text())
    # Its sockets closed with the server: the process ends by itself (no timing: a bound only).
    deadline = time.monotonic() + 60
    while not _gone(copier) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(copier)
    with Engine(settings.engine_config()) as eng:
        assert_invariants(eng, {"d/f.bin": data})
        assert eng.lookup("d/f.bin").tier == "nvme"
        eng.mover.settings.process_min = CHUNK
        eng.migrate(eng.lookup("d/f.bin").id, "hdd")  # and it moves again, through a new one
        assert_invariants(eng, {"d/f.bin": data})


def _direct_io(directory: Path) -> bool:
    try:
        fd = os.open(directory / ".probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(directory / ".probe")
    return True


def test_the_copy_goes_around_the_page_cache_and_the_tail_through_it(outside: Engine) -> None:
    """Where the tiers' filesystem takes ``O_DIRECT``, the copy process writes the aligned
    chunks with it (the kernel's writeback of a move's bytes was in the requests' tail) and
    reads the source with it, each through a descriptor of its own (those the server handed
    over share their open files with the server, and stay as they were); the file's unaligned
    tail goes through the page cache. The bytes arrive either way."""
    [root] = [t.watch_root() for t in outside.tiers if t.name == "ssd"]
    assert root is not None
    dest = Path(root)
    if not _direct_io(dest):
        pytest.skip(f"{dest}'s filesystem does not take O_DIRECT")
    data = payload(SIZE)  # four aligned chunks, then a short one
    put(outside, "f.bin", data)
    process = outside.mover.copy_process
    seen: list[tuple[list[int], list[int]]] = []

    def see() -> None:
        if process.pid is not None:
            seen.append((_flags(process.pid, ".tierd-tmp"), _flags(process.pid, "/f.bin")))

    _migrate_seeing(outside, outside.lookup("f.bin").id, "ssd", see)
    [(temp, source)] = seen
    assert sorted(bool(f & os.O_DIRECT) for f in temp) == [False, True]
    assert sorted(bool(f & os.O_DIRECT) for f in source) == [False, True]
    assert (dest / "f.bin").read_bytes() == data
    assert outside.lookup("f.bin").checksum == checksum(data)


def test_a_refused_direct_write_goes_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem or device that refuses a direct write (EINVAL: a larger block than the
    alignment) gets it written through the page cache instead, and every later one too."""
    from tiering.moves import _copyworker

    fd = os.open(tmp_path / "t", os.O_RDWR | os.O_CREAT, 0o600)
    out = _copyworker._Destination(fd, None)
    try:
        if not out.direct:
            pytest.skip(f"{tmp_path}'s filesystem does not take O_DIRECT")
        real = os.pwrite
        refused: list[int] = []

        def pwrite(f: int, data: memoryview, off: int) -> int:
            if f != fd:  # the direct descriptor
                refused.append(off)
                raise OSError(errno.EINVAL, "Invalid argument")  # the fault injected
            return real(f, data, off)

        monkeypatch.setattr(os, "pwrite", pwrite)
        buf = mmap.mmap(-1, 8192)
        buf[:] = b"ab" * 4096
        out.write(memoryview(buf)[:4096], 0)
        out.write(memoryview(buf)[4096:], 4096)
        assert refused == [0] and not out.direct
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT  # the given one never was
        assert os.pread(fd, 8192, 0) == b"ab" * 4096
    finally:
        out.close()
        os.close(fd)


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def test_the_copy_process_keeps_its_chunk_buffer_from_one_move_to_the_next(
    outside: Engine,
) -> None:
    """A new buffer's pages are faulted in and zeroed as the first chunk lands in them (half
    a 16 MiB chunk's copy time): the copy process keeps its buffers between moves, so a
    second move faults in almost none of its chunk's pages."""
    chunk = 4 << 20
    outside.mover.settings.process_chunk = chunk
    data = payload(2 * chunk + 1000)
    rec = put(outside, "f.bin", data)
    outside.migrate(rec.id, "ssd")
    pid = outside.mover.copy_process.pid
    assert pid is not None
    before = _minor_faults(pid)
    outside.migrate(rec.id, "nvme")
    assert outside.mover.copy_process.pid == pid
    assert _minor_faults(pid) - before < (chunk >> 12) // 4, "the buffer was made again"
    assert outside.get(rec.id).checksum == checksum(data)
