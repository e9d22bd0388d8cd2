"""Background jobs (prefetch) with progress, cancellation and bounded concurrency."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from tiering.errors import JobNotFound, Unavailable

__all__ = ["Job", "JobCancelled", "JobTable"]

log = logging.getLogger(__name__)


class JobCancelled(Exception):
    """Raised inside a job's work when its cancel event is set."""


@dataclass
class Job:
    """One job: what it does, how far it got, and how it ended.

    ``state`` is ``queued``, ``running``, ``done``, ``failed`` or ``cancelled``.
    """

    id: str
    kind: str
    target: str
    files_total: int
    bytes_total: int
    device: str | None = None
    state: str = "queued"
    files_done: int = 0
    bytes_done: int = 0
    error: str | None = None
    errors: list[dict[str, object]] = field(default_factory=list)
    #: Bytes by where they came from (``bucket``, ``peer:<host>``), for fills of host copies.
    sources: dict[str, int] = field(default_factory=dict)
    lease_ids: list[str] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    #: Set once the job has ended (``finished``), so a follower wakes at the end at once.
    ended: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    FINISHED = frozenset({"done", "failed", "cancelled"})

    @property
    def finished(self) -> bool:
        return self.state in self.FINISHED

    def check(self) -> None:
        """Raise :class:`JobCancelled` if the job was cancelled (call between steps)."""
        if self.cancel.is_set():
            raise JobCancelled

    def add(self, nbytes: int = 0, files: int = 0) -> None:
        with self.lock:
            self.bytes_done += nbytes
            self.files_done += files

    def add_source(self, source: str, nbytes: int) -> None:
        with self.lock:
            self.sources[source] = self.sources.get(source, 0) + nbytes


class JobTable:
    """Runs jobs on ``concurrency`` threads and keeps finished ones for ``retention_s``."""

    def __init__(self, *, concurrency: int = 2, retention_s: float = 3600.0) -> None:
        self.retention_s = retention_s
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="tierd-job")
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        self._futures: dict[str, Future[None]] = {}
        self._closed = False

    def submit(
        self, job: Job, work: Callable[[Job], None], cleanup: Callable[[Job], None] | None = None
    ) -> Job:
        """Queue ``work(job)``. ``cleanup(job)`` runs after a failed or cancelled job."""
        job.id = job.id or secrets.token_hex(8)
        with self._lock:
            if self._closed:
                raise Unavailable("the service is stopping")
            self._prune()
            self._jobs[job.id] = job
            self._futures[job.id] = self._pool.submit(self._run, job, work, cleanup)
        return job

    def _run(
        self, job: Job, work: Callable[[Job], None], cleanup: Callable[[Job], None] | None
    ) -> None:
        with job.lock:
            if job.cancel.is_set():
                job.state, job.finished_at = "cancelled", time.time()
                job.ended.set()
                return
            job.state, job.started_at = "running", time.time()
        state, error = "done", None
        try:
            work(job)
            if job.cancel.is_set():
                state = "cancelled"
            elif job.errors:
                state, error = "failed", f"{len(job.errors)} file(s) failed"
        except JobCancelled:
            state = "cancelled"
        except Exception as exc:
            log.exception("job %s failed", job.id)
            state, error = "failed", str(getattr(exc, "message", None) or exc)
        if state != "done" and cleanup is not None:
            try:
                cleanup(job)
            except Exception:
                log.exception("cleaning up job %s failed", job.id)
        with job.lock:
            job.state, job.error, job.finished_at = state, error, time.time()
        job.ended.set()

    def get(self, job_id: str) -> Job:
        with self._lock:
            self._prune()
            job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFound(f"no job with id {job_id!r}", job_id=job_id)
        return job

    def all(self) -> list[Job]:
        with self._lock:
            self._prune()
            return list(self._jobs.values())

    def cancel(self, job_id: str) -> Job:
        """Ask a job to stop; a queued one never starts. Finished jobs are left as they are."""
        job = self.get(job_id)
        job.cancel.set()
        with self._lock:
            fut = self._futures.get(job_id)
        if fut is not None and fut.cancel():
            with job.lock:
                job.state, job.finished_at = "cancelled", time.time()
            job.ended.set()
        return job

    def _prune(self) -> None:
        cutoff = time.time() - self.retention_s
        for jid in [
            j.id
            for j in self._jobs.values()
            if j.finished and j.finished_at is not None and j.finished_at < cutoff
        ]:
            self._jobs.pop(jid, None)
            self._futures.pop(jid, None)

    def stop(self) -> None:
        """Cancel every job and wait for the running ones to stop."""
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
        for job in jobs:
            job.cancel.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for job in jobs:
            with job.lock:
                if not job.finished:
                    job.state, job.finished_at = "cancelled", time.time()
            job.ended.set()
