"""tierd's shared-memory segments: their names, whose run they are, and the sweep at start of
what a run that is gone left behind.

A ``cpu`` lease's buffer is a file in ``/dev/shm`` (see :mod:`tiering.io.buffers`) named
``tierd-<pid>-<token>-<hex>`` (``tierd-<pid>-<token>-idle-<hex>`` while it waits in a pool for
its next lease). ``<pid>-<token>`` names the process's run: the pid for people, and a random
token because a pid is no identity: a tierd restarted in its container is pid 1 again, in the
same ``/dev/shm`` where a pod keeps it, and tierds in two pid namespaces sharing ``/dev/shm``
can have one pid between them.

Before its first segment a run makes its marker ``tierd-run-<pid>-<token>`` and holds an
exclusive ``flock`` on it for its life; the kernel drops that lock when the process dies,
whatever kills it. tmpfs keeps a segment's pages until it is unlinked, so a kill -9 left every
live lease's and idle pool's segment holding host memory until reboot: :func:`sweep_segments`
removes the segments (and the marker) of each run whose marker it can lock, and of a run
whose marker is gone. Any other file, and a live run's segments, are never touched.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["SHM_DIR", "SHM_PREFIX", "idle_prefix", "run_name", "segment_name", "sweep_segments"]

SHM_PREFIX = "tierd-"
SHM_DIR = Path("/dev/shm")
_MARKER = f"{SHM_PREFIX}run-"
_SEGMENT = re.compile(rf"^{SHM_PREFIX}(\d+-[0-9a-f]{{16}})-")

_lock = threading.Lock()
#: This process's run: (its pid, ``<pid>-<token>``, the fd holding the marker's lock).
_run: tuple[int, str, int] | None = None


def run_name() -> str:
    """This process's run, ``<pid>-<token>``; its marker is made and locked on first use (a
    forked child starts a run of its own)."""
    global _run
    with _lock:
        if _run is None:
            name = f"{os.getpid()}-{secrets.token_hex(8)}"
            _run = (os.getpid(), name, _hold(SHM_DIR / f"{_MARKER}{name}"))
        return _run[1]


def segment_name() -> str:
    """A fresh name for a segment of this run."""
    return f"{SHM_PREFIX}{run_name()}-{secrets.token_hex(8)}"


def idle_prefix() -> str:
    """The name prefix of released segments waiting in a
    :class:`~tiering.io.bufferpool.BufferPool` for their next lease: no lease's name ever
    opens them."""
    return f"{SHM_PREFIX}{run_name()}-idle-"


def _hold(path: Path) -> int:
    """Make ``path`` and hold an exclusive lock on it, for as long as the fd is open. A sweep
    that locked the new file first (took it for a dead run's) removes it: it is made again."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _forget_in_child() -> None:
    """A forked child's run is its own: the parent's lock stays the parent's."""
    global _run, _lock
    _lock = threading.Lock()
    if _run is not None:
        with contextlib.suppress(OSError):
            os.close(_run[2])  # the parent holds the lock through its own fd
    _run = None


def _end_run() -> None:
    """At a clean exit, the marker goes with the run's last segment; where segments are left,
    it stays (unlocked once this process is gone) for the next start's sweep."""
    if _run is None or _run[0] != os.getpid():
        return
    prefix = f"{SHM_PREFIX}{_run[1]}-"
    with contextlib.suppress(OSError):
        if not any(n.startswith(prefix) for n in os.listdir(SHM_DIR)):
            os.unlink(SHM_DIR / f"{_MARKER}{_run[1]}")


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(_end_run)


@contextlib.contextmanager
def _gone(marker: Path) -> Iterator[bool]:
    """Whether the run of ``marker`` is gone: its marker is missing, or nobody holds its lock
    (then held here until the block ends: the run cannot be taken for alive meanwhile)."""
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        yield True
        return
    except OSError:
        yield False  # not a file we may open: not ours to judge
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            held = True  # the run is alive
        else:
            held = False
        yield not held
    finally:
        os.close(fd)


def _runs(where: Path) -> dict[str, list[str]]:
    """The runs with segments or a marker of this user in ``where``: their segments' names."""
    runs: dict[str, list[str]] = {}
    uid = os.getuid()
    try:
        entries = list(os.scandir(where))
    except OSError:
        return runs
    for entry in entries:
        m = _SEGMENT.match(entry.name)
        if m is None and not entry.name.startswith(_MARKER):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        if m is None:
            runs.setdefault(entry.name.removeprefix(_MARKER), [])
        else:
            runs.setdefault(m.group(1), []).append(entry.name)
    return runs


def sweep_segments(directory: Path | None = None) -> list[str]:
    """Remove the shared-memory segments of tierd runs that are gone (a kill -9 leaves its
    leases' and its idle pool's segments behind: tmpfs holds their pages until they are
    unlinked), with their markers; the segments' names removed. A run is gone when nobody
    holds its marker's lock (the kernel dropped it with the process) or its marker is
    missing; a live run's segments are never taken, whatever its pid."""
    where = directory or SHM_DIR
    own = _run[1] if _run is not None else None
    removed = []
    for run, names in _runs(where).items():
        if run == own:
            continue
        marker = where / f"{_MARKER}{run}"
        with _gone(marker) as gone:
            if not gone:
                continue
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(where / name)
                    removed.append(name)
            with contextlib.suppress(OSError):
                os.unlink(marker)
    return removed
