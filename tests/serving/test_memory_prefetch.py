"""Prefetch into the memory tier (target ``memory``), in-process: a job with progress whose
copies are kept whatever their heat, loads served from them, a file that does not fit reported
per file, cancellation, and a clear error where no memory tier is configured."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.helpers import engine_settings, put
from tests.placement.memory_support import MiB, cached_ids, copy_rows, memory_settings
from tiering.engine import Engine
from tiering.errors import InvalidInput
from tiering.serving import Job, Loader, LoaderConfig

KiB = 1 << 10


@pytest.fixture
def ld(tmp_path: Path) -> Iterator[Loader]:
    settings = memory_settings(tmp_path / "data", quota=2 * MiB)
    with Engine(settings.engine_config()) as eng:
        loader = Loader(eng, LoaderConfig(cpu_budget_bytes=16 * MiB)).start()
        try:
            yield loader
        finally:
            loader.stop()


def finished(job: Job) -> Job:
    wait_for(lambda: job.finished, what=f"job {job.id} to finish")
    return job


def test_memory_prefetch_copies_files_and_loads_use_them(ld: Loader) -> None:
    eng = ld.engine
    data = {f"m/{i}.bin": os.urandom(300 * KiB + i) for i in range(3)}
    ids = [put(eng, p, d, tier="hdd").id for p, d in data.items()]
    job = finished(ld.prefetch([*ids, ids[0]], target="memory", ttl_s=600))
    assert job.state == "done" and job.errors == [], job.errors
    assert job.files_done == job.files_total == 3
    assert job.bytes_done == job.bytes_total == sum(len(d) for d in data.values())
    assert cached_ids(eng) == sorted(ids)
    assert sorted(r.file_id for r in copy_rows(eng)) == sorted(ids)
    # Cold files (one access each), yet kept: the prefetch holds them for ttl_s.
    assert eng.memory is not None
    assert not eng.memory.run_pass().plan.drops
    for p, d in data.items():
        lease = ld.load(p, device="cpu")
        assert lease.report is not None and lease.report.source == "memory"
        got = lease.buffer.array()[lease.offset : lease.offset + lease.nbytes]
        assert bytes(got) == d
        ld.leases.release(lease.id)
    # A second prefetch of files already there is done at once.
    again = finished(ld.prefetch(ids, target="memory"))
    assert again.state == "done" and again.files_done == 3 and again.errors == []


def test_a_file_that_does_not_fit_is_the_jobs_error_for_that_file(ld: Loader) -> None:
    eng = ld.engine
    small = put(eng, "s.bin", b"s" * 1000)
    big = put(eng, "b.bin", os.urandom(3 * MiB))  # over the 2 MiB quota
    job = finished(ld.prefetch([big.id, small.id], target="memory"))
    assert job.state == "failed" and job.files_done == 2  # the other file went in
    [err] = job.errors
    assert err["file_id"] == big.id and err["code"] == "insufficient_space"
    assert cached_ids(eng) == [small.id]


def test_cancel_stops_the_copy(ld: Loader, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = ld.engine
    rec = put(eng, "c.bin", os.urandom(2 * MiB - 1))
    real = os.preadv

    asked, reading = threading.Event(), threading.Event()

    def slow(fd: int, buffers: list[memoryview], offset: int) -> int:
        # Every read waits for the cancel: on a loaded machine (the suite's other workers) a
        # read that only slept could finish the copy before the cancel came.
        reading.set()
        asked.wait(10)
        time.sleep(0.05)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", slow)
    job = ld.prefetch([rec.id], target="memory")
    # The cancel comes while the copy's reads are in flight, its last one included (a fill
    # that looked for a cancel only before each read kept the copy: seen once under load).
    assert reading.wait(10)
    ld.jobs.cancel(job.id)
    asked.set()
    assert finished(job).state == "cancelled"
    assert cached_ids(eng) == [] and copy_rows(eng) == []
    assert eng.memory is not None and eng.memory.tier.used_bytes == 0


def test_model_prefetch_into_memory(ld: Loader) -> None:
    eng = ld.engine
    a = put(eng, "models/t/model-1.safetensors", b"\0" * 5000)
    b = put(eng, "models/t/model-2.safetensors", b"\1" * 7000)
    job = finished(ld.models.prefetch("models/t", target="memory"))
    assert job.state == "done" and job.bytes_done == 12000
    assert cached_ids(eng) == sorted([a.id, b.id])


def test_bad_memory_prefetches_are_refused_before_a_job_starts(ld: Loader, tmp_path: Path) -> None:
    rec = put(ld.engine, "x.bin", b"x")
    with pytest.raises(InvalidInput, match="device applies to target gpu only"):
        ld.prefetch([rec.id], target="memory", device="cpu")
    with pytest.raises(InvalidInput, match="ttl_s"):
        ld.prefetch([rec.id], target="memory", ttl_s=-1)
    assert ld.jobs.all() == []
    with Engine(engine_settings(tmp_path / "plain").engine_config()) as eng:
        assert eng.memory is None
        plain = Loader(eng).start()
        try:
            other = put(eng, "x.bin", b"x")
            with pytest.raises(InvalidInput, match="needs a memory tier"):
                plain.prefetch([other.id], target="memory")
            assert plain.jobs.all() == []
        finally:
            plain.stop()
