"""What a kill -9 leaves in /dev/shm is swept at the next start (RELIABILITY.md row 32): the
dead run's segments are removed, and only tierd's of runs that are gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierd_bench.rest import server_process
from tierd_client import Client
from tiering.io.shm import sweep_segments

SHM = Path("/dev/shm")


def _segments(pid: int) -> set[str]:
    return {p.name for p in SHM.glob(f"tierd-{pid}-*")}


def test_a_killed_servers_segments_are_removed_at_the_next_start(tmp_path: Path) -> None:
    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        pytest.skip("/dev/shm is not writable here")
    data = tmp_path / "data"
    (data / "nvme").mkdir(parents=True)
    (data / "nvme" / "w.bin").write_bytes(os.urandom(1 << 20))  # adopted at start
    foreign = SHM / f"not-tierd-{os.getpid()}"
    foreign.write_bytes(b"someone else's")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    kept = SHM / f"tierd-{live.pid}-livesegment"  # a live process's: never taken
    kept.write_bytes(b"in use")
    try:
        with server_process(data) as (url, pid), Client(url) as api:
            lease = api.load("w.bin", device="cpu")  # a live cpu lease: a segment
            assert lease.nbytes == 1 << 20
            assert _segments(pid), "the lease's segment is in /dev/shm"
            os.kill(pid, signal.SIGKILL)  # no cleanup of any kind
            deadline = time.monotonic() + 20
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        assert _segments(pid), "kill -9 leaves the segments (what the sweep is for)"
        with server_process(data):
            assert _segments(pid) == set(), "the dead run's segments stay"
        assert foreign.exists() and kept.exists()
    finally:
        live.kill()
        live.wait()
        for p in (foreign, kept):
            p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"


def test_the_sweep_takes_only_tierds_segments_of_runs_that_are_gone(shm_dir: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names no process now
    mine = shm_dir / f"tierd-{os.getpid()}-abc"  # this process's own
    gone = [shm_dir / f"tierd-{dead.pid}-0123", shm_dir / f"tierd-{dead.pid}-idle-4567"]
    other = shm_dir / f"other-{dead.pid}-0123"
    for p in (mine, other, *gone):
        p.write_bytes(b"x")
    assert sorted(sweep_segments(shm_dir)) == sorted(p.name for p in gone)
    assert mine.exists() and other.exists() and not any(p.exists() for p in gone)
    assert sweep_segments(shm_dir) == []  # twice: nothing more
