"""Fleet jobs in the shared catalog: one request (a prefetch to some hosts) with one task per
host, which only that host runs.

A host *claims* its own next task (``SELECT ... FOR UPDATE SKIP LOCKED``: two claimers never
take one row, and neither waits on the other), *renews* the claim with its progress while it
works, and *finishes* it. Every write after the claim is a compare-and-set on the claim
(``claimed_by``, ``attempts``, ``state = running``), so a host whose claim was lost (the job was
cancelled, or the task failed for its host's silence) finds out at its next write and stops.

A claim past ``claim_expires`` is as good as none: a host that died mid-task leaves one, and
takes the task again when it returns (prefetch is idempotent: files already warm are done at
once). A host that never returns leaves its task open until :meth:`FleetJobs.expire`, which
any host runs, marks it ``failed`` with the reason: no heartbeat for longer than
``task_timeout_s``.

What a job and its tasks are, as read, is in :mod:`tiering.fleet.jobstate`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import and_, exists, or_, select, update
from sqlalchemy.orm import Session

from tiering.catalog.db import Database
from tiering.catalog.models import FleetJob, FleetTask, HostRow
from tiering.errors import InvalidInput
from tiering.fleet.jobstate import (
    CANCELLED,
    DONE,
    FAILED,
    MAX_ERRORS,
    OPEN,
    QUEUED,
    RUNNING,
    Claim,
    FleetJobNotFound,
    JobFile,
    JobInfo,
    job_info,
    loads,
)
from tiering.fleet.wakeups import notify_new_job

__all__ = ["FleetJobs"]


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def _sources_json(sources: Mapping[str, int] | None) -> str | None:
    return json.dumps(dict(sources), sort_keys=True) if sources else None


def _errors_json(errors: Sequence[dict[str, Any]]) -> str | None:
    return json.dumps(list(errors[:MAX_ERRORS])) if errors else None


class FleetJobs:
    """Fleet jobs over one :class:`Database`, as host ``host`` sees and runs them.

    ``claim_ttl_s``: how long a claim holds without a renewal; ``task_timeout_s``: how long a
    host may be silent (no heartbeat) before :meth:`expire` fails its open tasks.
    """

    def __init__(
        self,
        db: Database,
        *,
        host: str,
        claim_ttl_s: float = 30.0,
        task_timeout_s: float = 300.0,
    ) -> None:
        self.db = db
        self.host = host
        self.claim_ttl_s = claim_ttl_s
        self.task_timeout_s = task_timeout_s

    # -- requests ---------------------------------------------------------------------------
    def create(
        self,
        *,
        target: str,
        files: Sequence[JobFile],
        hosts: Sequence[str],
        kind: str = "prefetch",
        model: str | None = None,
        device: str | None = None,
        now: float | None = None,
    ) -> JobInfo:
        """Record a job with one queued task per host, in one transaction (all or nothing).

        Hosts and files are checked by the caller (their existence, liveness and bounds): this
        refuses only an empty or repeated list, which no caller should send.
        """
        if not files or not hosts or len(set(hosts)) != len(hosts):
            raise InvalidInput("a fleet job needs files and distinct hosts")
        now = time.time() if now is None else now
        spec = {
            "files": [{"id": f.id, "path": f.path, "size": f.size} for f in files],
            "model": model,
            "hosts": list(hosts),
            "device": device,
        }
        total = sum(f.size for f in files)

        def body(s: Session) -> int:
            job = FleetJob(
                kind=kind,
                target=target,
                spec=json.dumps(spec),
                created_by=self.host,
                created_at=now,
                cancelled_at=None,
            )
            s.add(job)
            s.flush()
            for h in hosts:
                s.add(
                    FleetTask(
                        job_id=job.id,
                        host=h,
                        state=QUEUED,
                        attempts=0,
                        files_total=len(files),
                        bytes_total=total,
                        files_done=0,
                        bytes_done=0,
                        updated_at=now,
                    )
                )
            notify_new_job(s, self.db, job.id)
            return job.id

        return self.get(self.db.transact(body, changes_files=False))

    def get(self, job_id: int) -> JobInfo:
        with self.db.read() as s:
            job = s.get(FleetJob, job_id)
            if job is None:
                raise FleetJobNotFound(f"no fleet job with id {job_id}", job_id=job_id)
            tasks = s.scalars(select(FleetTask).where(FleetTask.job_id == job_id)).all()
            return job_info(job, tasks)

    def page(self, *, limit: int = 50, before: int | None = None) -> list[JobInfo]:
        """Jobs newest first, ``limit`` of them, with ids below ``before`` when given (the
        last id of the previous page)."""
        q = select(FleetJob).order_by(FleetJob.id.desc()).limit(max(1, limit))
        if before is not None:
            q = q.where(FleetJob.id < before)
        with self.db.read() as s:
            jobs = s.scalars(q).all()
            by_job: dict[int, list[FleetTask]] = {j.id: [] for j in jobs}
            if by_job:
                tq = select(FleetTask).where(FleetTask.job_id.in_(list(by_job)))
                for t in s.scalars(tq):
                    by_job[t.job_id].append(t)
            return [job_info(j, by_job[j.id]) for j in jobs]

    def cancel(self, job_id: int, *, now: float | None = None) -> JobInfo:
        """Cancel every task not finished; a host running one sees it at its next renewal
        and stops. A finished job is returned as it is."""
        now = time.time() if now is None else now

        def body(s: Session) -> None:
            job = s.get(FleetJob, job_id, with_for_update=True)
            if job is None:
                raise FleetJobNotFound(f"no fleet job with id {job_id}", job_id=job_id)
            q = (
                update(FleetTask)
                .where(FleetTask.job_id == job_id, FleetTask.state.in_(OPEN))
                .values(state=CANCELLED, finished_at=now, updated_at=now, claim_expires=None)
            )
            if s.execute(q).rowcount and job.cancelled_at is None:  # type: ignore[attr-defined]
                job.cancelled_at = now

        self.db.transact(body, changes_files=False)
        return self.get(job_id)

    # -- this host's side ---------------------------------------------------------------------
    def _runnable(self, now: float, resume: bool) -> Any:
        expired = and_(FleetTask.state == RUNNING, FleetTask.claim_expires < now)
        cond = or_(FleetTask.state == QUEUED, expired)
        if resume:
            # At start: this host's running tasks are its previous incarnation's (the catalog
            # lock lets one tierd run per host id), whatever their claim's expiry says.
            cond = or_(cond, and_(FleetTask.state == RUNNING, FleetTask.claimed_by == self.host))
        return and_(FleetTask.host == self.host, cond)

    def has_runnable(self, *, resume: bool = False, now: float | None = None) -> bool:
        """Whether :meth:`claim` would find a task: a read, so an idle host's poll never takes
        the catalog's write lock (SQLite has one writer)."""
        now = time.time() if now is None else now
        with self.db.read() as s:
            q = select(FleetTask.id).where(self._runnable(now, resume)).limit(1)
            return s.scalar(q) is not None

    def claim(self, *, resume: bool = False, now: float | None = None) -> Claim | None:
        """Claim this host's oldest runnable task (queued, or running with an expired claim;
        with ``resume``, any of its running ones), or None."""
        now = time.time() if now is None else now

        def body(s: Session) -> Claim | None:
            q = (
                select(FleetTask)
                .where(self._runnable(now, resume))
                .order_by(FleetTask.job_id, FleetTask.id)
                .limit(1)
                .with_for_update(skip_locked=True)
            )
            task = s.scalars(q).first()
            if task is None:
                return None
            job = s.get(FleetJob, task.job_id)
            assert job is not None  # the foreign key
            task.state = RUNNING
            task.claimed_by = self.host
            task.claim_expires = now + self.claim_ttl_s
            task.attempts += 1
            task.started_at = task.started_at or now
            task.updated_at = now
            task.error = None
            spec = loads(job.spec, {})
            return Claim(
                task.id,
                job.id,
                self.host,
                task.attempts,
                job.target,
                spec if isinstance(spec, dict) else {},
                task.files_total,
                task.bytes_total,
            )

        return self.db.transact(body, changes_files=False)

    def _cas(self, q: Any) -> bool:
        """Run one conditional update; whether it changed a row (its condition held)."""
        return self.db.transact(
            lambda s: bool(s.execute(q).rowcount),  # type: ignore[attr-defined]
            changes_files=False,
        )

    def _held(self, claim: Claim) -> Any:
        return and_(
            FleetTask.id == claim.task_id,
            FleetTask.state == RUNNING,
            FleetTask.claimed_by == claim.host,
            FleetTask.attempts == claim.attempt,
        )

    def renew(
        self,
        claim: Claim,
        *,
        files_done: int,
        bytes_done: int,
        errors: Sequence[dict[str, Any]] = (),
        sources: Mapping[str, int] | None = None,
        now: float | None = None,
    ) -> bool:
        """Write progress and extend the claim; False when the claim was lost (the task was
        cancelled, failed by :meth:`expire`, or claimed again): stop working on it."""
        now = time.time() if now is None else now
        q = (
            update(FleetTask)
            .where(self._held(claim))
            .values(
                files_done=files_done,
                bytes_done=bytes_done,
                errors=_errors_json(errors),
                sources=_sources_json(sources),
                claim_expires=now + self.claim_ttl_s,
                updated_at=now,
            )
        )
        return self._cas(q)

    def finish(
        self,
        claim: Claim,
        *,
        files_done: int,
        bytes_done: int,
        errors: Sequence[dict[str, Any]] = (),
        error: str | None = None,
        sources: Mapping[str, int] | None = None,
        now: float | None = None,
    ) -> str | None:
        """End a claimed task; returns its state, or None when the claim was lost.

        ``error`` (the whole task failed) makes it ``failed``; so does a per-file error for
        every file. Some files failing leaves it ``done``, with ``errors`` listing them.
        """
        now = time.time() if now is None else now
        failed_files = len({e.get("file_id", i) for i, e in enumerate(errors)})
        if error is None and errors and failed_files >= claim.files_total:
            error = f"every file failed ({failed_files} of {claim.files_total})"
        state = FAILED if error is not None else DONE
        q = (
            update(FleetTask)
            .where(self._held(claim))
            .values(
                state=state,
                files_done=files_done,
                bytes_done=bytes_done,
                errors=_errors_json(errors),
                error=error,
                sources=_sources_json(sources),
                claim_expires=None,
                finished_at=now,
                updated_at=now,
            )
        )
        return state if self._cas(q) else None

    # -- any host's sweep -----------------------------------------------------------------------
    def expire(self, *, now: float | None = None) -> list[int]:
        """Fail the open tasks of hosts silent for longer than ``task_timeout_s`` (or not
        registered at all), with the reason; returns their ids. A task whose claim is still
        live is left alone: its host is renewing it. Idempotent, and safe to run on every host
        at once (each write is a compare-and-set on the task's state)."""
        now = time.time() if now is None else now
        cutoff = now - self.task_timeout_s
        no_live_claim = or_(FleetTask.claim_expires.is_(None), FleetTask.claim_expires < now)
        q = (
            select(FleetTask.id, FleetTask.host, FleetTask.state, HostRow.last_heartbeat)
            .outerjoin(HostRow, HostRow.host_id == FleetTask.host)
            .where(
                FleetTask.state.in_(OPEN),
                no_live_claim,
                or_(HostRow.host_id.is_(None), HostRow.last_heartbeat < cutoff),
            )
            .order_by(FleetTask.id)
        )
        with self.db.read() as s:
            stale = list(s.execute(q).all())
        failed: list[int] = []
        for task_id, host, state, beat in stale:
            if beat is None:
                reason = f"host {host} is not registered in the catalog (it never sent a heartbeat)"
            else:
                reason = (
                    f"host {host} has been down since {_iso(beat)} (no heartbeat for "
                    f"{now - beat:.0f} s, over fleet_task_timeout_s={self.task_timeout_s:g})"
                )
            # Compare-and-set on what was read: a task its host claimed or renewed since, or
            # whose host has sent a heartbeat since, is left alone, and so is one another
            # host's sweep has failed already.
            back = exists().where(HostRow.host_id == host, HostRow.last_heartbeat >= cutoff)
            cas = update(FleetTask).where(
                FleetTask.id == task_id, FleetTask.state == state, no_live_claim, ~back
            )
            cas = cas.values(
                state=FAILED, error=reason, claim_expires=None, finished_at=now, updated_at=now
            )
            if self._cas(cas):
                failed.append(task_id)
        return failed
