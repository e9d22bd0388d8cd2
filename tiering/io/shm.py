"""Shared-memory segments a tierd run that is gone left behind, swept at the next start.

A ``cpu`` lease's buffer is a file in ``/dev/shm`` (see :mod:`tiering.io.buffers`), named
``tierd-<pid>-...``. tmpfs keeps a segment's pages until it is unlinked, so a kill -9 of the
server left every live lease's and idle pool's segment holding host memory until reboot.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from .buffers import _SHM_DIR, SHM_PREFIX

__all__ = ["sweep_segments"]

_SEGMENT = re.compile(rf"^{SHM_PREFIX}(\d+)-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, and not ours to judge
    return True


def sweep_segments(directory: Path | None = None) -> list[str]:
    """Remove the shared-memory segments of tierd runs that are gone (a kill -9 leaves its
    leases' and its idle pool's segments behind: tmpfs holds their pages until they are
    unlinked); the names removed. A segment is tierd's by its name (``tierd-<pid>-...``) and
    this user's, and its run is gone when no process has its pid here. A live process of
    that pid (a new one that took the number) keeps it: a segment is never taken from a
    process that may use it."""
    where = directory or _SHM_DIR
    uid = os.getuid()
    removed = []
    try:
        entries = list(os.scandir(where))
    except OSError:
        return []
    for entry in entries:
        m = _SEGMENT.match(entry.name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            if not entry.is_file(follow_symlinks=False) or entry.stat().st_uid != uid:
                continue
        except OSError:
            continue
        if _alive(int(m.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed.append(entry.name)
    return removed
