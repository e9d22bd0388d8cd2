"""Opening a file for a storage: the tier it lies under, the I/O path that tier gets, the
backend's handle, and read-ahead turned off."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiering.errors import FileNotFound

from ._backends import Chosen
from ._config import GdsConfig
from ._device import Device
from ._file import GdsFile

__all__ = ["TierOf", "open_gds_file"]

TierOf = Callable[[Path], tuple[str, int] | None]
"""``tier_of(path)``: the ``(name, rank)`` of the tier whose root contains ``path``, if any."""


def _no_readahead(fd: int, handle: Any) -> None:
    """Turn off read-ahead on the file's descriptors.

    A cold 4 KiB read would otherwise pull in 128 KiB around it (p99 latency), while large
    reads lose nothing: with FADV_RANDOM the kernel still reads each request whole.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    fds = [fd]
    if handle is not None and hasattr(handle, "fileno"):
        fds.append(int(handle.fileno()))
    for d in fds:
        with contextlib.suppress(OSError):
            os.posix_fadvise(d, 0, 0, os.POSIX_FADV_RANDOM)


def open_gds_file(
    path: str | os.PathLike[str],
    fd: int | None,
    *,
    device: Device,
    config: GdsConfig,
    chosen: Chosen,
    tier_of: TierOf,
    owner: object,
) -> GdsFile:
    """Open ``path`` (or duplicate ``fd``) as a :class:`GdsFile` owned by ``owner``.

    See :meth:`GpuDirectStorage.open_file <tiering.io.GpuDirectStorage.open_file>`.
    """
    p = Path(path)
    by_fd = fd is not None
    try:
        fd = os.dup(fd) if fd is not None else os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
        raise FileNotFound(f"no such file: {p}", path=str(p)) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileNotFound(f"not a regular file: {p}", path=str(p))
        found = tier_of(p)
        tier, rank = found if found else (None, None)
        io = config.io_for(tier, rank)
        direct = bool(
            device.is_cuda
            and chosen.gds_available
            and (io.direct if io.direct is not None else rank in (None, 0))
        )
        name = f"/proc/self/fd/{fd}" if by_fd else str(p)
        handle = chosen.backend.open(name, direct) if device.is_cuda else None
        _no_readahead(fd, handle)
        io_path = chosen.backend.io_path(handle, device)
    except BaseException:
        os.close(fd)
        raise
    return GdsFile(
        p,
        fd,
        st.st_size,
        tier=tier,
        rank=rank,
        alignment=config.alignment,
        handle=handle,
        io_path=io_path,
        owner=owner,
    )
