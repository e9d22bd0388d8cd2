"""Fleet jobs in the catalog, on SQLite and on a real PostgreSQL: a task per host, claimed only
by its host and only once at a time (two claimers at once never share a task), progress
written under the claim, a lost claim refused, silent hosts' tasks failed with the reason, and
a job's state derived from its tasks'."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pg_support import BACKENDS
from tiering.catalog.db import Database, upgrade
from tiering.catalog.hosts import Hosts
from tiering.errors import InvalidInput, NotFound
from tiering.fleet.jobs import FleetJobs
from tiering.fleet.jobstate import JobFile, job_state
from tiering.fleet.wakeups import JobWakeups

FILES = [JobFile(1, "m/a.bin", 100), JobFile(2, "m/b.bin", 50)]


@pytest.fixture(params=BACKENDS)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "postgresql":
        url = str(request.getfixturevalue("pg_url"))
    else:
        url = f"sqlite:///{tmp_path / 'c.db'}"
        upgrade(url)
    database = Database(url)
    yield database
    database.dispose()


def _register(db: Database, *hosts: str, now: float | None = None) -> None:
    for h in hosts:
        Hosts(db).register(h, address=f"http://{h}", version="t", report="{}", now=now)


def test_each_host_claims_only_its_own_task_once(db: Database) -> None:
    _register(db, "a", "b")
    a, b = FleetJobs(db, host="a"), FleetJobs(db, host="b")
    job = a.create(target="page_cache", files=FILES, hosts=["a", "b"], model="m")
    assert job.state == "queued" and [t.host for t in job.tasks] == ["a", "b"]
    assert job.total("files_total") == 4 and job.total("bytes_total") == 300
    assert job.spec["model"] == "m" and [f.path for f in FILES] == ["m/a.bin", "m/b.bin"]

    ca = a.claim()
    assert ca is not None and (ca.job_id, ca.host, ca.attempt) == (job.id, "a", 1)
    assert ca.files == FILES and ca.target == "page_cache"
    assert a.claim() is None and not a.has_runnable()  # its one task is held
    assert b.has_runnable()
    assert a.get(job.id).state == "running"

    assert a.renew(ca, files_done=1, bytes_done=100)
    t = a.get(job.id).tasks[0]
    assert (t.state, t.claimed_by, t.files_done, t.bytes_done) == ("running", "a", 1, 100)
    assert a.finish(ca, files_done=2, bytes_done=150) == "done"
    assert not a.renew(ca, files_done=2, bytes_done=150)  # finished: the claim is gone
    assert a.get(job.id).state == "running"  # b's task is still queued

    cb = b.claim()
    assert cb is not None
    errors = [{"file_id": 2, "path": "m/b.bin", "code": "x", "message": "no"}]
    assert b.finish(cb, files_done=2, bytes_done=150, errors=errors) == "done"
    done = a.get(job.id)
    assert done.state == "done" and done.finished_at is not None
    assert done.tasks[1].errors == errors and done.tasks[1].error is None


def test_every_file_failing_fails_the_task_and_the_job(db: Database) -> None:
    _register(db, "a")
    a = FleetJobs(db, host="a")
    job = a.create(target="memory", files=FILES, hosts=["a"])
    c = a.claim()
    assert c is not None
    errors = [{"file_id": f.id, "code": "x", "message": "no"} for f in FILES]
    assert a.finish(c, files_done=2, bytes_done=150, errors=errors) == "failed"
    got = a.get(job.id)
    assert got.state == "failed" and got.tasks[0].error == "every file failed (2 of 2)"


def test_an_expired_claim_is_taken_again_and_the_old_one_refused(db: Database) -> None:
    _register(db, "a")
    a = FleetJobs(db, host="a", claim_ttl_s=5)
    a.create(target="nvme", files=FILES, hosts=["a"])
    now = time.time()
    first = a.claim(now=now)
    assert first is not None
    assert a.claim(now=now + 1) is None  # still held
    second = a.claim(now=now + 6)  # its holder died: the claim lapsed
    assert second is not None and second.attempt == 2
    # The first holder's writes are refused: it must stop.
    assert not a.renew(first, files_done=1, bytes_done=1)
    assert a.finish(first, files_done=2, bytes_done=150) is None
    assert a.renew(second, files_done=1, bytes_done=100)
    # A restarted host takes its own running task at once, whatever the expiry says.
    third = a.claim(resume=True)
    assert third is not None and third.attempt == 3
    assert a.finish(third, files_done=2, bytes_done=150) == "done"


def test_two_claimers_at_once_never_share_a_task(db: Database) -> None:
    _register(db, "a")
    a = FleetJobs(db, host="a")
    for _ in range(6):
        a.create(target="page_cache", files=FILES[:1], hosts=["a"])
    claimers = [FleetJobs(Database(db.url), host="a") for _ in range(3)]
    got: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(len(claimers))

    def claim_all(jobs: FleetJobs) -> None:
        start.wait()
        while (c := jobs.claim()) is not None:
            with lock:
                got.append(c.task_id)

    threads = [threading.Thread(target=claim_all, args=(j,)) for j in claimers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for j in claimers:
        j.db.dispose()
    assert len(got) == 6 and len(set(got)) == 6, got
    assert all(t.attempts == 1 for j in a.page() for t in j.tasks)


def test_a_silent_hosts_tasks_fail_with_the_reason(db: Database) -> None:
    now = time.time()
    _register(db, "a", now=now)
    _register(db, "c", now=now - 400)  # silent for 400 s
    a = FleetJobs(db, host="a", task_timeout_s=300)
    job = a.create(target="page_cache", files=FILES, hosts=["a", "c"], now=now - 500)
    gone = a.create(target="page_cache", files=FILES, hosts=["ghost"], now=now)
    failed = a.expire(now=now)
    assert len(failed) == 2
    assert a.expire(now=now) == []  # idempotent
    t = {x.host: x for x in a.get(job.id).tasks}
    assert t["a"].state == "queued"  # its host is up
    assert t["c"].state == "failed"
    assert t["c"].error is not None and t["c"].error.startswith("host c has been down since ")
    assert "no heartbeat for 400 s, over fleet_task_timeout_s=300" in t["c"].error
    assert "not registered" in (a.get(gone.id).tasks[0].error or "")
    assert a.get(gone.id).state == "failed"
    # A running task whose claim is live is left alone, however old its host's heartbeat.
    c = FleetJobs(db, host="c", claim_ttl_s=1000)
    j2 = a.create(target="page_cache", files=FILES, hosts=["c"], now=now)
    assert c.claim(now=now) is not None
    assert a.expire(now=now) == []
    assert a.get(j2.id).state == "running"
    # A host that comes back in time keeps its tasks.
    j3 = a.create(target="page_cache", files=FILES, hosts=["c"], now=now)
    _register(db, "c", now=now)
    assert a.expire(now=now) == [] and a.get(j3.id).state == "queued"


def test_cancel_stops_open_tasks_and_a_runner_finds_out(db: Database) -> None:
    _register(db, "a", "b")
    a, b = FleetJobs(db, host="a"), FleetJobs(db, host="b")
    job = a.create(target="page_cache", files=FILES, hosts=["a", "b"])
    ca = a.claim()
    assert ca is not None and a.finish(ca, files_done=2, bytes_done=150) == "done"
    cb = b.claim()
    assert cb is not None
    got = a.cancel(job.id)
    assert got.state == "cancelled" and got.cancelled_at is not None
    assert [t.state for t in got.tasks] == ["done", "cancelled"]
    assert not b.renew(cb, files_done=1, bytes_done=1)  # b stops at its next write
    assert b.finish(cb, files_done=1, bytes_done=1) is None
    assert a.cancel(job.id).tasks == got.tasks  # again: nothing changes
    with pytest.raises(NotFound):
        a.cancel(10**9)
    with pytest.raises(NotFound):
        a.get(10**9)


def test_jobs_are_listed_newest_first_a_page_at_a_time(db: Database) -> None:
    _register(db, "a")
    a = FleetJobs(db, host="a")
    ids = [a.create(target="page_cache", files=FILES, hosts=["a"]).id for _ in range(5)]
    first = a.page(limit=2)
    assert [j.id for j in first] == ids[::-1][:2]
    rest = a.page(limit=10, before=first[-1].id)
    assert [j.id for j in rest] == ids[::-1][2:]
    assert all(len(j.tasks) == 1 for j in rest)


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        (["queued", "queued"], "queued"),
        (["queued", "running"], "running"),
        (["queued", "done"], "running"),
        (["done", "done"], "done"),
        (["done", "failed"], "failed"),
        (["failed", "running"], "running"),
        (["done", "cancelled"], "cancelled"),
        (["failed", "cancelled"], "failed"),
    ],
)
def test_a_jobs_state_comes_from_its_tasks(states: list[str], expected: str) -> None:
    assert job_state(states) == expected


def test_a_new_job_wakes_the_hosts_waiting_for_one(db: Database) -> None:
    """On PostgreSQL a host waiting for work is woken by the job's commit (LISTEN/NOTIFY), not
    at its next poll; a job rolled back wakes nobody. On SQLite (one host) a poke wakes it."""
    _register(db, "a", "b")
    waiting = JobWakeups(db)
    stop = threading.Event()
    try:
        if db.single_writer:
            threading.Timer(0.2, waiting.poke).start()
            assert waiting.wait(60.0, stop) is True
            assert waiting.wait(0.1, stop) is False  # a poke wakes one wait
            return
        assert waiting.wait(0.3, stop) is False  # listening now; nothing announced
        with pytest.raises(InvalidInput):  # refused inside: rolled back, never announced
            FleetJobs(db, host="a").create(target="page_cache", files=FILES, hosts=["a", "a"])
        assert waiting.wait(0.5, stop) is False
        woke: list[bool] = []
        t = threading.Thread(target=lambda: woke.append(waiting.wait(60.0, stop)))
        t.start()
        time.sleep(0.3)
        started = time.monotonic()
        FleetJobs(db, host="a").create(target="page_cache", files=FILES, hosts=["a", "b"])
        t.join(timeout=30)
        assert woke == [True] and time.monotonic() - started < 30
    finally:
        stop.set()
        waiting.close()
