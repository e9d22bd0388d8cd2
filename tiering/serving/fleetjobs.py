"""This host's side of fleet jobs: a thread that claims this host's tasks from the shared
catalog and runs each as a local prefetch job, writing its progress back to the task.

Every ``poll_interval_s`` the thread fails the tasks of hosts that went silent (see
:meth:`~tiering.fleet.jobs.FleetJobs.expire`; any host may), then claims its own next task.
A task runs through :meth:`tiering.serving.Loader.prefetch`, so it is also a local job that
``GET /v1/jobs`` lists. While it runs, its files and bytes done are copied into the task row
every ``progress_interval_s``, which renews the claim; a renewal that finds the claim lost (the
fleet job was cancelled) cancels the local job.

The catalog may be unreachable for a while (PostgreSQL restarting): the thread never dies of
it. It logs once, backs off, and tries again; a local job already running goes on, and its
progress and end are written once the catalog is back. A task this host had claimed and not
finished when it stopped (or was killed) is claimed again at its next start and run again:
prefetch is idempotent, files already warm are done at once.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from tiering.errors import TierdError, Unavailable
from tiering.fleet.jobs import FleetJobs
from tiering.fleet.jobstate import Claim
from tiering.fleet.wakeups import JobWakeups
from tiering.serving.jobs import Job
from tiering.serving.loader import Loader

__all__ = ["FleetWorker", "FleetWorkerConfig"]

log = logging.getLogger(__name__)

#: The longest wait between two tries while the catalog cannot be reached.
MAX_BACKOFF_S = 30.0
#: Per-file error codes that say "not now" rather than "not this file": the catalog (or a
#: tier) could not be reached. Such files run again once the catalog answers.
TRANSIENT = frozenset({"unavailable", "catalog_busy", "tier_unavailable"})
#: How many times a task runs its files again after transient failures before it ends with
#: them as its errors.
MAX_ROUNDS = 5


@dataclass(frozen=True)
class FleetWorkerConfig:
    """``poll_interval_s``: how often an idle host looks for its tasks; ``claim_ttl_s``: how
    long a claim holds unrenewed; ``task_timeout_s``: how long a host may send no heartbeat
    before its open tasks fail; ``progress_interval_s``: how often a running task's progress
    is written (and its claim renewed)."""

    poll_interval_s: float = 1.0
    claim_ttl_s: float = 30.0
    task_timeout_s: float = 300.0
    progress_interval_s: float = 0.5


class FleetWorker:
    """Runs this host's fleet tasks on one thread, from :meth:`start` to :meth:`stop`.

    Stop it before the loader: a task cut short by :meth:`stop` keeps its claim, and this
    host takes it again at its next start.
    """

    def __init__(self, loader: Loader, config: FleetWorkerConfig | None = None) -> None:
        self.loader = loader
        self.config = config or FleetWorkerConfig()
        engine = loader.engine
        self.host = engine.config.host_id
        self.jobs = FleetJobs(
            engine.catalog.db,
            host=self.host,
            claim_ttl_s=self.config.claim_ttl_s,
            task_timeout_s=self.config.task_timeout_s,
        )
        self.wakeups = JobWakeups(engine.catalog.db)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        # Until a claim has gone through once, this host's running tasks are its previous
        # incarnation's, to be taken again whatever their claim's expiry.
        self._resume = True
        self._outage = False

    def start(self) -> FleetWorker:
        if self._thread is None:
            self._stopped.clear()
            name = f"tierd-fleet-worker-{self.host}"[:60]
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.wakeups.close()

    # -- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        delay = self.config.poll_interval_s
        while True:
            # Until a new job is announced (LISTEN/NOTIFY on PostgreSQL), or the next poll.
            self.wakeups.wait(delay, self._stopped)
            if self._stopped.is_set():
                return
            try:
                self.tick()
                delay = self.config.poll_interval_s
            except Exception as exc:
                delay = self._backoff(delay, exc)

    def _backoff(self, delay: float, exc: Exception) -> float:
        """The next wait after a failed tick: doubling up to :data:`MAX_BACKOFF_S`. A catalog
        outage is logged once, when it starts; anything else every time, with its trace."""
        if isinstance(exc, Unavailable):
            if not self._outage:
                log.warning("fleet jobs pause: %s; trying again", exc.message)
            self._outage = True
        else:
            log.exception("fleet worker of %s failed; trying again", self.host)
        return min(MAX_BACKOFF_S, max(delay, self.config.poll_interval_s) * 2)

    def _recovered(self) -> None:
        if self._outage:
            log.info("fleet jobs resume: the catalog answers again")
            self._outage = False

    def tick(self) -> bool:
        """One poll: the sweep of silent hosts' tasks, then this host's next task, run to its
        end. Returns whether a task ran."""
        self.jobs.expire()
        self._recovered()
        if not self.jobs.has_runnable(resume=self._resume):
            self._resume = False
            return False
        claim = self.jobs.claim(resume=self._resume)
        self._resume = False
        if claim is None:
            return False
        log.info(
            "fleet job %d: %s of %d file(s) to %s on %s (attempt %d)",
            claim.job_id,
            "prefetch",
            claim.files_total,
            claim.target,
            self.host,
            claim.attempt,
        )
        self.run(claim)
        return True

    # -- one task -----------------------------------------------------------------------------
    def _reachable(self, claim: Claim) -> tuple[list[int], list[dict[str, Any]], int]:
        """The files of ``claim`` this host can read now, and an error for each other one
        (gone from the catalog, or on another host's own tier), with their bytes."""
        ids: list[int] = []
        errors: list[dict[str, Any]] = []
        skipped_bytes = 0
        for f in claim.files:
            try:
                rec = self.loader.engine.get(f.id)
            except Unavailable:
                raise  # the catalog's trouble, not the file's
            except TierdError as exc:
                errors.append(_file_error(f.id, f.path, exc.code, exc.message))
                skipped_bytes += f.size
                continue
            if rec.host is not None and rec.host != self.host:
                msg = (
                    f"{rec.relpath!r} is on host {rec.host}'s own tier {rec.tier}, which host "
                    f"{self.host} cannot read"
                )
                errors.append(_file_error(rec.id, rec.relpath, "not_on_this_host", msg))
                skipped_bytes += rec.size
                continue
            ids.append(rec.id)
        return ids, errors, skipped_bytes

    def run(self, claim: Claim) -> None:
        """Run a claimed task to its end, or until its claim is lost or this worker stops."""
        job: Job | None = None
        error: str | None = None
        try:
            ids, skipped, skipped_bytes = self._reachable(claim)
            if ids:
                job = self.loader.prefetch(
                    ids, target=claim.target, device=claim.spec.get("device")
                )
        except Unavailable:
            # The catalog went away (or the loader is stopping) before the job started: the
            # claim stays this host's, and the next tick takes it again as its own.
            self._resume = True
            if self._stopped.is_set():
                return
            raise
        except TierdError as exc:  # a target or device this host cannot serve
            error = f"host {self.host}: {exc.message}"
        if job is not None and not self._follow(claim, job, skipped, skipped_bytes):
            return
        rounds = 0
        while job is not None and rounds < MAX_ROUNDS and _transient(job):
            # Files that failed because the catalog (or a tier) could not be reached: once it
            # answers, the whole task runs again (prefetch is idempotent: what is already
            # warm is done at once), so an outage delays the job instead of failing it.
            rounds += 1
            log.info(
                "fleet job %d on %s: files failed while unreachable; running again (round %d)",
                claim.job_id,
                self.host,
                rounds,
            )
            if not self._until_reachable(claim, job, skipped, skipped_bytes):
                return
            try:
                job = self.loader.prefetch(
                    ids, target=claim.target, device=claim.spec.get("device")
                )
            except Unavailable:
                continue  # gone again: the next round waits for it
            if not self._follow(claim, job, skipped, skipped_bytes):
                return
        files, nbytes, errors = _progress(job, skipped, skipped_bytes)
        if job is not None:
            with job.lock:
                if job.state == "cancelled":
                    error = f"the local prefetch job {job.id} on host {self.host} was cancelled"
                elif job.state == "failed" and job.error and not job.errors:
                    error = f"host {self.host}: {job.error}"
        self._finish(claim, files, nbytes, errors, error, _sources(job))

    def _follow(self, claim: Claim, job: Job, skipped: list[dict[str, Any]], sb: int) -> bool:
        """Copy ``job``'s progress into the task until it ends; False when it was stopped
        (the claim lost, or this worker stopping), True when it ended on its own."""
        while not job.finished:
            # Woken by the job's end at once (a fleet job's latency is not a polling step).
            job.ended.wait(self.config.progress_interval_s)
            if self._stopped.is_set():
                self._abandon(job)
                return False
            if job.finished:
                break
            files, nbytes, errors = _progress(job, skipped, sb)
            try:
                held = self.jobs.renew(
                    claim,
                    files_done=files,
                    bytes_done=nbytes,
                    errors=errors,
                    sources=_sources(job),
                )
            except Unavailable as exc:
                # The local job goes on: its end is written once the catalog is back.
                self._backoff(0.0, exc)
                continue
            self._recovered()
            if not held:
                log.info("fleet job %d: the claim was lost (cancelled?); stopping", claim.job_id)
                self._abandon(job)
                return False
        return True

    def _until_reachable(
        self, claim: Claim, job: Job, skipped: list[dict[str, Any]], sb: int
    ) -> bool:
        """Wait until the catalog answers (a renewal of the claim goes through); False when
        the claim was lost or this worker stops first."""
        delay = self.config.poll_interval_s
        while True:
            files, nbytes, errors = _progress(job, skipped, sb)
            try:
                held = self.jobs.renew(
                    claim,
                    files_done=files,
                    bytes_done=nbytes,
                    errors=errors,
                    sources=_sources(job),
                )
            except Unavailable as exc:
                delay = self._backoff(delay, exc)
                if self._stopped.wait(delay):
                    return False
                continue
            self._recovered()
            if not held:
                log.info("fleet job %d: the claim was lost (cancelled?); stopping", claim.job_id)
            return held

    def _abandon(self, job: Job) -> None:
        self.loader.jobs.cancel(job.id)
        while not job.finished and not self._stopped.wait(0.05):
            pass

    def _finish(
        self,
        claim: Claim,
        files: int,
        nbytes: int,
        errors: list[dict[str, Any]],
        error: str | None,
        sources: dict[str, int] | None = None,
    ) -> None:
        """Write the task's end, trying again while the catalog cannot be reached; if this
        worker stops first, the claim stays and the task runs again at the next start."""
        delay = self.config.poll_interval_s
        while True:
            try:
                state = self.jobs.finish(
                    claim,
                    files_done=files,
                    bytes_done=nbytes,
                    errors=errors,
                    error=error,
                    sources=sources,
                )
            except Unavailable as exc:
                delay = self._backoff(delay, exc)
                if self._stopped.wait(delay):
                    return
                continue
            self._recovered()
            log.info("fleet job %d on %s: %s", claim.job_id, self.host, state or "claim lost")
            return


def _transient(job: Job) -> bool:
    with job.lock:
        return job.state != "cancelled" and any(e.get("code") in TRANSIENT for e in job.errors)


def _sources(job: Job | None) -> dict[str, int]:
    """Bytes by source of the job's fills so far (``bucket``, ``peer:<host>``)."""
    if job is None:
        return {}
    with job.lock:
        return dict(job.sources)


def _file_error(file_id: int, path: str, code: str, message: str) -> dict[str, Any]:
    return {"file_id": file_id, "path": path, "code": code, "message": message}


def _progress(
    job: Job | None, skipped: list[dict[str, Any]], skipped_bytes: int
) -> tuple[int, int, list[dict[str, Any]]]:
    """Files and bytes done, and per-file errors, of the files skipped and of ``job``."""
    if job is None:
        return len(skipped), skipped_bytes, list(skipped)
    with job.lock:
        return (
            len(skipped) + job.files_done,
            skipped_bytes + job.bytes_done,
            [*skipped, *job.errors],
        )
