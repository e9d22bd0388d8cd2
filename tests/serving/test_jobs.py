"""Prefetch jobs: progress, every target, cancellation, and the client's progress bar."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from tests.serving.conftest import leased
from tierd_client import Client


def _wait_state(api: Client, job_id: str, states: tuple[str, ...], timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = api.job(job_id)
        if job["state"] in states or time.monotonic() > deadline:
            return job
        time.sleep(0.02)


def test_page_cache_prefetch_reports_progress(api, upload, capsys):
    ids = [upload(f"p/{i}.bin", os.urandom(100_000 + i)) for i in range(3)]
    job = api.prefetch(ids, target="page_cache", wait=True, progress=True, poll_s=0.02)
    assert job["state"] == "done" and job["error"] is None
    assert job["files_done"] == job["files_total"] == 3
    assert job["bytes_done"] == job["bytes_total"] == 300_003
    assert job["progress"] == 1.0 and job["finished_at"] >= job["started_at"]
    assert "prefetch page_cache" in capsys.readouterr().err  # the rich progress bar


def test_gpu_target_keeps_warm_leases(api, upload):
    """target gpu on the cpu device (CI): each file ends up in a lease the client can open."""
    data = os.urandom(70_000)
    fid = upload("warm.bin", data)
    job = api.prefetch([fid, fid], target="gpu", device="cpu", wait=True, progress=False)
    assert job["state"] == "done" and job["files_total"] == 1  # the same file once
    (buffer_id,) = job["buffer_ids"]
    with api.open_buffer(buffer_id) as b:
        assert np.asarray(b).tobytes() == data
    assert leased(api) == 0


def test_nvme_target_promotes_through_the_mover(api, upload):
    fid = upload("cold/x.bin", b"x" * 200_000, tier="hdd")
    hot = upload("hot/y.bin", b"y" * 1000)  # already on the fastest tier
    job = api.prefetch([fid, hot], target="nvme", wait=True, progress=False)
    assert job["state"] == "done", job
    assert job["bytes_done"] == job["bytes_total"] == 201_000
    assert api.file(fid)["tier"] == "nvme"


@pytest.fixture
def gate(monkeypatch):
    """Hold every ``os.preadv`` of the server until released: jobs stop mid-file."""
    real = os.preadv
    opened = threading.Event()
    entered = threading.Event()

    def held(fd, buffers, offset, *a):
        entered.set()
        opened.wait(10)
        return real(fd, buffers, offset, *a)

    monkeypatch.setattr(os, "preadv", held)
    yield entered, opened
    opened.set()


def test_cancel_a_running_and_a_queued_job(api, upload, gate, buffer_settings):
    entered, opened = gate
    ids = [upload(f"c/{i}.bin", b"c" * 100_000) for i in range(2)]
    # prefetch_concurrency is 2: two running jobs fill the pool, the third waits.
    running = api.prefetch(ids, target="page_cache")
    other = api.prefetch(ids[:1], target="page_cache")
    queued = api.prefetch(ids[:1], target="gpu", device="cpu")
    assert entered.wait(5)
    assert api.job(queued["id"])["state"] == "queued"
    assert api.cancel(queued["id"])["state"] == "cancelled"
    assert api.cancel(running["id"])["state"] in ("running", "cancelled")
    opened.set()
    done = _wait_state(api, running["id"], ("done", "failed", "cancelled"))
    assert done["state"] == "cancelled"
    assert done["bytes_done"] < done["bytes_total"] and done["files_done"] < 2
    assert _wait_state(api, other["id"], ("done",))["state"] == "done"
    assert api.job(queued["id"])["state"] == "cancelled"
    # A finished job is left as it is.
    assert api.cancel(other["id"])["state"] == "done"
    assert leased(api) == 0


def test_cancelled_gpu_prefetch_releases_its_leases(api, upload, gate):
    entered, opened = gate
    ids = [upload(f"g/{i}.bin", b"g" * 50_000) for i in range(3)]
    job = api.prefetch(ids, target="gpu", device="cpu")
    assert entered.wait(5)
    api.cancel(job["id"])
    opened.set()
    final = _wait_state(api, job["id"], ("done", "failed", "cancelled"))
    assert final["state"] == "cancelled" and final["buffer_ids"] == []
    assert leased(api) == 0


def test_listing_jobs(api, upload):
    fid = upload("l.bin", b"l")
    job = api.prefetch(fid, target="page_cache", wait=True, progress=False)
    assert job["id"] in [j["id"] for j in api.request("GET", "/v1/jobs")]
