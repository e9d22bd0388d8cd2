"""What a kill -9 leaves in /dev/shm is swept at the next start (RELIABILITY.md row 32): the
dead run's segments are removed, and only tierd's of runs that are gone. A run is told by its
marker's lock, not its pid: a restarted tierd can have its predecessor's pid (pid 1 in a
container), and a live tierd in another pid namespace a pid that is free here."""

from __future__ import annotations

import fcntl
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierd_bench.rest import server_process
from tierd_client import Client
from tiering.io.shm import run_name, sweep_segments

SHM = Path("/dev/shm")

# A live run of tierd's own buffer code in another process: it prints its segment's name and
# keeps the segment (and its run's lock) until its stdin closes.
_LIVE = (
    "import sys; from tiering.io import Device; from tiering.io.buffers import allocate; "
    "b = allocate(Device('cpu'), 4096); print(b.handle()['name'], flush=True); sys.stdin.read()"
)


def _segments(pid: int) -> set[str]:
    return {p.name for p in SHM.glob(f"tierd-{pid}-*")}


def _run_files(pid: int) -> set[str]:
    return _segments(pid) | {p.name for p in SHM.glob(f"tierd-run-{pid}-*")}


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 20
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        try:  # a zombie still has /proc/<pid>: it has died once stat says Z
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return
        except OSError:
            return
        time.sleep(0.02)


def test_a_killed_servers_segments_are_removed_at_the_next_start(tmp_path: Path) -> None:
    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        pytest.skip("/dev/shm is not writable here")
    data = tmp_path / "data"
    (data / "nvme").mkdir(parents=True)
    (data / "nvme" / "w.bin").write_bytes(os.urandom(1 << 20))  # adopted at start
    foreign = SHM / f"not-tierd-{secrets.token_hex(6)}"
    foreign.write_bytes(b"someone else's")
    live = subprocess.Popen(
        [sys.executable, "-c", _LIVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert live.stdout is not None
        kept = SHM / live.stdout.readline().strip()  # a live run's segment: never taken
        assert kept.name.startswith(f"tierd-{live.pid}-") and kept.exists()
        with server_process(data) as (url, pid), Client(url) as api:
            lease = api.load("w.bin", device="cpu")  # a live cpu lease: a segment
            assert lease.nbytes == 1 << 20
            assert _segments(pid), "the lease's segment is in /dev/shm"
            os.kill(pid, signal.SIGKILL)  # no cleanup of any kind
            _wait_gone(pid)
        # kill -9 leaves the segments (what the sweep is for); not asserted here, as a server
        # another test worker starts meanwhile may sweep them first, which is the same code.
        with server_process(data):
            assert _run_files(pid) == set(), "the dead run's segments (or marker) stay"
        assert foreign.exists() and kept.exists()
    finally:
        live.kill()
        live.wait()
        foreign.unlink(missing_ok=True)
    sweep_segments()  # that run is gone now: its segment goes too
    assert _run_files(live.pid) == set()


def _run(where: Path, pid: int, *, marker: bool = True) -> tuple[str, list[Path]]:
    run = f"{pid}-{secrets.token_hex(8)}"
    files = [where / f"tierd-{run}-{secrets.token_hex(8)}", where / f"tierd-{run}-idle-0a1b"]
    if marker:
        files.append(where / f"tierd-run-{run}")
    for p in files:
        p.write_bytes(b"x")
    return run, files


def test_a_run_is_gone_by_its_lock_whatever_its_pid(shm_dir: Path) -> None:
    # A predecessor with this very pid (a restarted container's pid 1): its lock is free.
    _, reused = _run(shm_dir, os.getpid())
    # A run whose marker is gone too (nothing else removes a marker of a live run).
    _, unmarked = _run(shm_dir, 999_999_999, marker=False)
    # A live run, in another pid namespace perhaps (its pid names no process here).
    live, held = _run(shm_dir, 999_999_998)
    fd = os.open(shm_dir / f"tierd-run-{live}", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    # This process's own run, and files that are not tierd's segments.
    own = shm_dir / f"tierd-{run_name()}-{secrets.token_hex(8)}"
    others = [shm_dir / "other-123-0123456789abcdef-x", shm_dir / "tierd-123-abc-x", own]
    (shm_dir / "tierd-test-dir").mkdir()
    for p in others:
        p.write_bytes(b"x")
    try:
        swept = sweep_segments(shm_dir)
    finally:
        os.close(fd)
    segments = [p for p in reused + unmarked if not p.name.startswith("tierd-run-")]
    assert sorted(swept) == sorted(p.name for p in segments)
    assert not any(p.exists() for p in reused + unmarked), "a gone run's marker goes too"
    assert all(p.exists() for p in held + others) and (shm_dir / "tierd-test-dir").is_dir()
    # Its lock dropped (the process died), the next sweep takes that run, and only it.
    assert sorted(sweep_segments(shm_dir)) == sorted(p.name for p in held[:2])
    assert all(p.exists() for p in others)
