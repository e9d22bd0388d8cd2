"""What a fleet job and its tasks are, as read from the catalog: plain values, and a job's
state derived from its tasks' (never stored, so it cannot disagree with them)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tiering.catalog.models import FleetJob, FleetTask
from tiering.errors import NotFound

__all__ = [
    "CANCELLED",
    "DONE",
    "FAILED",
    "FINISHED",
    "OPEN",
    "QUEUED",
    "RUNNING",
    "Claim",
    "MAX_ERRORS",
    "FleetJobNotFound",
    "JobFile",
    "JobInfo",
    "TaskInfo",
    "job_state",
    "job_info",
    "loads",
]

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"
OPEN = (QUEUED, RUNNING)
FINISHED = (DONE, FAILED, CANCELLED)
#: Most per-file errors kept on a task (a model of thousands of files that all fail must not
#: write megabytes into a row at every renew); the count of files done still covers them all.
MAX_ERRORS = 100


class FleetJobNotFound(NotFound):
    code = "job_not_found"


@dataclass(frozen=True)
class JobFile:
    """One file of a job, as it was when the job was created."""

    id: int
    path: str
    size: int


@dataclass(frozen=True)
class TaskInfo:
    id: int
    job_id: int
    host: str
    state: str
    claimed_by: str | None
    claim_expires: float | None
    attempts: int
    files_total: int
    bytes_total: int
    files_done: int
    bytes_done: int
    error: str | None
    errors: list[dict[str, Any]]
    started_at: float | None
    finished_at: float | None
    updated_at: float
    #: Bytes by source of the host's fills: ``bucket`` and ``peer:<host>``.
    sources: dict[str, int] = field(default_factory=dict)


def job_state(states: Sequence[str]) -> str:
    """A job's state from its tasks': ``done`` only when every task is; ``failed`` when any
    failed and none is still open; ``cancelled`` when the rest were cancelled; while any is
    open, ``running`` once any started (or finished), else ``queued``."""
    if any(s in OPEN for s in states):
        return QUEUED if all(s == QUEUED for s in states) else RUNNING
    if all(s == DONE for s in states):
        return DONE
    return FAILED if FAILED in states else CANCELLED


@dataclass(frozen=True)
class JobInfo:
    id: int
    kind: str
    target: str
    spec: dict[str, Any]
    created_by: str
    created_at: float
    cancelled_at: float | None
    tasks: list[TaskInfo] = field(default_factory=list)

    @property
    def state(self) -> str:
        return job_state([t.state for t in self.tasks])

    @property
    def finished_at(self) -> float | None:
        if self.state in OPEN:
            return None
        return max((t.finished_at or 0.0 for t in self.tasks), default=None)

    def total(self, name: str) -> int:
        """The sum of one counter (``files_done``, ``bytes_total``...) over the tasks."""
        return sum(int(getattr(t, name)) for t in self.tasks)


@dataclass(frozen=True)
class Claim:
    """A task this host holds: what to run, and what every later write compares against."""

    task_id: int
    job_id: int
    host: str
    attempt: int
    target: str
    spec: dict[str, Any]
    files_total: int
    bytes_total: int

    @property
    def files(self) -> list[JobFile]:
        return [JobFile(int(f["id"]), str(f["path"]), int(f["size"])) for f in self.spec["files"]]


def loads(text: str | None, default: Any) -> Any:
    if not text:
        return default
    try:
        return json.loads(text)
    except ValueError:
        return default


def _task(t: FleetTask) -> TaskInfo:
    errors = loads(t.errors, [])
    return TaskInfo(
        id=t.id,
        job_id=t.job_id,
        host=t.host,
        state=t.state,
        claimed_by=t.claimed_by,
        claim_expires=t.claim_expires,
        attempts=t.attempts,
        files_total=t.files_total,
        bytes_total=t.bytes_total,
        files_done=t.files_done,
        bytes_done=t.bytes_done,
        error=t.error,
        errors=errors if isinstance(errors, list) else [],
        started_at=t.started_at,
        finished_at=t.finished_at,
        updated_at=t.updated_at,
        sources=_sources(loads(t.sources, {})),
    )


def _sources(doc: Any) -> dict[str, int]:
    if not isinstance(doc, dict):
        return {}
    return {str(k): int(v) for k, v in doc.items() if isinstance(v, int)}


def job_info(j: FleetJob, tasks: Sequence[FleetTask]) -> JobInfo:
    spec = loads(j.spec, {})
    return JobInfo(
        id=j.id,
        kind=j.kind,
        target=j.target,
        spec=spec if isinstance(spec, dict) else {},
        created_by=j.created_by,
        created_at=j.created_at,
        cancelled_at=j.cancelled_at,
        tasks=[_task(t) for t in sorted(tasks, key=lambda t: t.host)],
    )
