"""kill -9 during a fill of the memory tier (RELIABILITY.md rows 1 and 21): the fill writes
nothing to disk, so nothing can be lost, and the restart forgets every copy the dead process
recorded. The fill runs in a forked engine, slowed by a patched ``os.preadv``."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

from app.settings import Settings
from tests.conftest import disk_snapshot, wait_for
from tests.helpers import assert_invariants, put
from tests.placement.memory_support import MiB, cached_ids, copy_rows, memory_settings
from tiering.engine import Engine
from tiering.serving import Loader


def _child(settings: Settings, done_id: int, slow_id: int, marker: str) -> None:
    # A forked process: open the engine (no threads), fill one file, then start the slow fill.
    try:
        eng = Engine(settings.engine_config()).open()
        assert eng.memory is not None
        eng.memory.fill(done_id)  # complete: its row is in the catalog
        real = os.preadv

        def slow(fd: int, buffers: list[memoryview], offset: int) -> int:
            Path(marker).touch()
            time.sleep(0.2)
            return real(fd, buffers, offset)

        os.preadv = slow  # type: ignore[assignment]
        eng.memory.fill(slow_id)
    finally:
        os._exit(3)  # reached only if the parent's SIGKILL never came


def test_kill_9_during_a_fill_loses_nothing(tmp_path: Path) -> None:
    settings = memory_settings(tmp_path / "data", quota=128 * MiB)
    files = {"done.bin": os.urandom(2 * MiB), "slow.bin": os.urandom(40 * MiB + 3)}
    with Engine(settings.engine_config()) as eng:
        ids = {p: put(eng, p, d, tier="ssd").id for p, d in files.items()}
    snap = disk_snapshot(settings.data_dir)
    marker = tmp_path / "filling"
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(
        target=_child, args=(settings, ids["done.bin"], ids["slow.bin"], str(marker))
    )
    child.start()
    try:
        wait_for(marker.exists, timeout=60, what="the slow fill to start")
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
    finally:
        child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert disk_snapshot(settings.data_dir) == snap  # a fill never writes a tier
    for _ in range(2):  # and starting twice changes nothing the second time
        with Engine(settings.engine_config()) as eng:
            assert copy_rows(eng) == [] and cached_ids(eng) == []
            assert_invariants(eng, files)
            ld = Loader(eng).start()
            try:
                assert eng.memory is not None
                eng.memory.fill(ids["slow.bin"])  # the fill works again after the crash
                lease = ld.load("slow.bin", device="cpu")
                assert lease.report is not None and lease.report.source == "memory"
                got = lease.buffer.array()[lease.offset : lease.offset + lease.nbytes]
                assert bytes(got) == files["slow.bin"]
                ld.leases.release(lease.id)
            finally:
                ld.stop()
        assert disk_snapshot(settings.data_dir) == snap
