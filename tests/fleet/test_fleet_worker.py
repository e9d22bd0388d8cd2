"""A host's fleet worker, in-process on a real engine and loader (SQLite, real temp tiers): it
takes back the task its previous incarnation held (the re-run after a kill -9), reports files it
cannot read (another host's own tier) per file, and stops a local job whose fleet job was
cancelled."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.catalog.conftest import run_sql
from tests.conftest import wait_for
from tests.helpers import engine_settings, payload, put
from tiering.engine import Engine
from tiering.fleet.jobs import FleetJobs
from tiering.fleet.jobstate import JobFile, JobInfo
from tiering.serving import Loader, LoaderConfig
from tiering.serving.fleetjobs import FleetWorker, FleetWorkerConfig

MiB = 1 << 20
FAST = FleetWorkerConfig(poll_interval_s=0.05, progress_interval_s=0.05)


@pytest.fixture
def loader(tmp_path: Path) -> Iterator[Loader]:
    settings = engine_settings(
        tmp_path / "data", host_id="h1", advertise_url="http://h1:1", scan_on_start=False
    )
    with Engine(settings.engine_config()) as eng:
        ld = Loader(eng, LoaderConfig(cpu_budget_bytes=16 * MiB)).start()
        try:
            yield ld
        finally:
            ld.stop()


def _jobs(ld: Loader) -> FleetJobs:
    return FleetJobs(ld.engine.catalog.db, host="h1")


def _finished(jobs: FleetJobs, job_id: int) -> JobInfo:
    job: JobInfo = wait_for(
        lambda: (j := jobs.get(job_id)).state not in ("queued", "running") and j,
        what=f"fleet job {job_id}",
    )
    return job


def test_a_task_held_by_a_dead_incarnation_is_run_again(loader: Loader) -> None:
    rec = put(loader.engine, "m/a.bin", payload(100_000, 1), tier="ssd")
    jobs = _jobs(loader)
    job = jobs.create(target="nvme", files=[JobFile(rec.id, rec.relpath, rec.size)], hosts=["h1"])
    assert jobs.claim() is not None  # then "killed": the claim is still live
    worker = FleetWorker(loader, FAST).start()
    try:
        done = _finished(jobs, job.id)
    finally:
        worker.stop()
    [t] = done.tasks
    assert (done.state, t.attempts, t.files_done, t.bytes_done) == ("done", 2, 1, rec.size)
    assert loader.engine.get(rec.id).tier == "nvme"


def test_files_on_another_hosts_tier_are_errors_of_that_file(loader: Loader) -> None:
    eng = loader.engine
    mine = put(eng, "m/mine.bin", payload(5000, 2))
    theirs = put(eng, "m/theirs.bin", payload(7000, 3))
    url = eng.config.catalog_url
    run_sql(url, "UPDATE files SET host = 'h2' WHERE id = :i", {"i": theirs.id})
    jobs = _jobs(loader)
    files = [JobFile(r.id, r.relpath, r.size) for r in (mine, theirs)]
    some = jobs.create(target="page_cache", files=files, hosts=["h1"])
    none = jobs.create(target="page_cache", files=files[1:], hosts=["h1"])
    worker = FleetWorker(loader, FAST).start()
    try:
        a, b = _finished(jobs, some.id), _finished(jobs, none.id)
    finally:
        worker.stop()
    [ta], [tb] = a.tasks, b.tasks
    assert (a.state, ta.files_done, ta.bytes_done) == ("done", 2, mine.size + theirs.size)
    [err] = ta.errors
    assert (err["file_id"], err["code"]) == (theirs.id, "not_on_this_host")
    assert "host h2's own tier nvme" in err["message"]
    assert (b.state, tb.error) == ("failed", "every file failed (1 of 1)")


def test_a_cancelled_fleet_job_stops_the_local_job(
    loader: Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = put(loader.engine, "big.bin", os.urandom(4 * MiB))
    real = os.preadv

    def slow(fd: int, buffers: list[memoryview], offset: int) -> int:
        time.sleep(0.2)
        return real(fd, [b[: 64 * 1024] for b in buffers], offset)

    monkeypatch.setattr(os, "preadv", slow)
    jobs = _jobs(loader)
    job = jobs.create(
        target="page_cache", files=[JobFile(rec.id, rec.relpath, rec.size)], hosts=["h1"]
    )
    worker = FleetWorker(loader, FAST).start()
    try:
        wait_for(lambda: jobs.get(job.id).tasks[0].bytes_done > 0, what="progress")
        assert jobs.cancel(job.id).state == "cancelled"
        [local] = loader.jobs.all()
        wait_for(lambda: local.finished, what="the local job to stop")
    finally:
        worker.stop()
    assert local.state == "cancelled" and local.bytes_done < rec.size
    [t] = jobs.get(job.id).tasks
    assert t.state == "cancelled" and t.bytes_done < rec.size
