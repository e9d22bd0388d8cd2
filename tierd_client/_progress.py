"""Following a job to its end, with a progress bar on stderr.

The bar is rich's where rich is installed (it comes with the server, not with the client);
otherwise a plain line of text, so that the client needs neither.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

__all__ = ["FINISHED", "follow"]

FINISHED = ("done", "failed", "cancelled")
"""A job in one of these states changes no more."""

Job = dict[str, Any]


class _Display(Protocol):
    def __enter__(self) -> _Display: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    def update(self, job: Job) -> None: ...


class _Silent:
    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, job: Job) -> None:
        pass


class _RichBar:
    """rich's progress bar: bytes, speed, files and time left."""

    def __init__(self, job: Job) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TextColumn("{task.fields[files]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = self._bar.add_task(
            f"prefetch {job['target']}", total=job["bytes_total"] or None, files=""
        )

    def __enter__(self) -> _RichBar:
        self._bar.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._bar.__exit__(exc_type, exc, tb)

    def update(self, job: Job) -> None:
        self._bar.update(
            self._task,
            completed=job["bytes_done"],
            files=f"{job['files_done']}/{job['files_total']} files",
        )


class _TextBar:
    """One line on stderr: rewritten in place on a terminal, else written when the job ends."""

    def __init__(self, job: Job) -> None:
        self._title = f"prefetch {job['target']}"
        self._tty = sys.stderr.isatty()
        self._start = time.monotonic()
        self._last = ""

    def __enter__(self) -> _TextBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._last:
            sys.stderr.write(("\r" if self._tty else "") + self._last + "\n")
            sys.stderr.flush()

    def update(self, job: Job) -> None:
        done, total = job["bytes_done"], job["bytes_total"]
        rate = done / max(time.monotonic() - self._start, 1e-9)
        percent = f"{100 * done / total:3.0f}% " if total else ""
        self._last = (
            f"{self._title}: {percent}{_mib(done)}/{_mib(total)} MiB, {_mib(rate)} MiB/s, "
            f"{job['files_done']}/{job['files_total']} files, {job['state']}"
        )
        if self._tty:
            sys.stderr.write("\r" + self._last)
            sys.stderr.flush()


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f}"


def _display(job: Job, progress: bool) -> _Display:
    if not progress:
        return _Silent()
    try:
        return _RichBar(job)
    except ImportError:  # a client-only install: no rich
        return _TextBar(job)


def follow(
    job: Job,
    poll: Callable[[str], Job],
    *,
    progress: bool,
    poll_s: float,
    timeout: float | None,
) -> Job:
    """Poll ``job`` (``poll(job_id)`` gets its state) until it is finished; return that state.

    Raises
    ------
    TimeoutError
        The job is still running after ``timeout`` seconds (``None``: no limit).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    with _display(job, progress) as display:
        while True:
            display.update(job)
            if job["state"] in FINISHED:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job['id']} still {job['state']}")
            time.sleep(poll_s)
            job = poll(job["id"])


def finish(
    job: Job,
    poll: Callable[[str], Job],
    cancel: Callable[[str], Any],
    *,
    what: str,
    progress: bool,
    poll_s: float,
    timeout: float | None,
) -> Job:
    """:func:`follow` ``job`` to its end; cancel it when the wait is cut short (Ctrl-C, the
    timeout), and raise :class:`~tierd_client.JobFailed` naming ``what`` when it failed."""
    from ._exceptions import JobFailed, TierdClientError

    try:
        job = follow(job, poll, progress=progress, poll_s=poll_s, timeout=timeout)
    except BaseException:
        with contextlib.suppress(TierdClientError):
            cancel(job["id"])
        raise
    if job["state"] == "failed":
        raise JobFailed(f"{what} failed: {job['error']}", job)
    return job
