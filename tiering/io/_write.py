"""Writes from GPU or host memory to a new file, and their crash-safe publication: temp file
in the destination directory, fsync, no-clobber link, fsync of the directory."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tiering.errors import AlreadyExists, FileNotFound, InvalidPath, MisalignedBuffer
from tiering.tiers.paths import TEMP_SUFFIX, is_temp_name

from ._backends import Backend
from ._device import import_cupy
from ._stats import UNTIERED, IoPath, IoReport, Stats

__all__ = ["TMP_SUFFIX", "temp_name", "write_atomic", "write_buffer"]

TMP_SUFFIX = TEMP_SUFFIX
"""Every temporary file tierd creates ends with this; recovery may delete such files."""


def temp_name(final: Path) -> Path:
    """A fresh hidden temp name beside ``final``: ``.<name>.<random>.tierd-tmp``.

    The name part is reduced to the characters of tierd's temp namespace, so scans skip the file
    and recovery recognises it (see :func:`tiering.tiers.paths.is_temp_name`).
    """
    # Keep the result under NAME_MAX (255) however long the final name is.
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", final.name[:200])
    name = f".{stem}.{secrets.token_hex(6)}{TMP_SUFFIX}"
    assert is_temp_name(name)
    return final.with_name(name)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(backend: Backend, src: Any, final: Path, *, overwrite: bool) -> None:
    """Write flat uint8 ``src`` to ``final`` so that a crash never leaves a partial file.

    Raises
    ------
    AlreadyExists
        ``final`` exists and ``overwrite`` is false (checked first, and again atomically by
        the link, so a racing writer cannot be clobbered).
    FileNotFound
        The directory does not exist.
    """
    if final.name in ("", ".", "..") or final.name.endswith(TMP_SUFFIX):
        raise InvalidPath(f"cannot write to {final}", path=str(final))
    directory = final.parent
    if not directory.is_dir():
        raise FileNotFound(f"directory does not exist: {directory}", path=str(directory))
    if not overwrite and os.path.lexists(final):
        raise AlreadyExists(f"{final} already exists", path=str(final))
    tmp = temp_name(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    published = False
    try:
        try:
            backend.write(fd, str(tmp), src)
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, final)
        else:
            try:
                os.link(tmp, final)
            except FileExistsError as exc:
                raise AlreadyExists(f"{final} already exists", path=str(final)) from exc
            published = True
            os.unlink(tmp)
        published = True
        _fsync_dir(directory)
    finally:
        if not published or os.path.lexists(tmp):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def write_buffer(
    backend: Backend,
    stats: Stats,
    buffer: Any,
    path: str | os.PathLike[str],
    *,
    tier_of: Callable[[Path], tuple[str, int] | None],
    overwrite: bool,
) -> IoReport:
    """Write a C-contiguous buffer's bytes to ``path`` with :func:`write_atomic`, counted.

    See :meth:`GpuDirectStorage.write_from_gpu <tiering.io.GpuDirectStorage.write_from_gpu>`;
    ``tier_of`` names the tier of the destination directory, for the stats.
    """
    if hasattr(buffer, "__cuda_array_interface__"):
        cp = import_cupy()
        arr = cp.asarray(buffer)
        if not arr.flags.c_contiguous:
            raise MisalignedBuffer("buffer must be C-contiguous")
        flat = arr.reshape(-1).view(cp.uint8)
    else:
        arr = np.asarray(buffer)
        if not arr.flags.c_contiguous:
            raise MisalignedBuffer("buffer must be C-contiguous")
        flat = arr.reshape(-1).view(np.uint8)
    found = tier_of(Path(path).parent)
    tier_key = found[0] if found else UNTIERED
    on_gpu = hasattr(buffer, "__cuda_array_interface__")
    # Writes never take the direct path: they are rare, and the compat path's O_DIRECT
    # writes through a bounce buffer are what KvikIO does without nvidia-fs anyway.
    io_path: IoPath = "compat" if on_gpu and backend.name == "kvikio" else "host"
    started = stats.begin(io_path, tier_key)
    ok = False
    try:
        write_atomic(backend, flat, Path(path), overwrite=overwrite)
        ok = True
    finally:
        seconds = stats.end(io_path, tier_key, started, flat.nbytes, ok)
    return IoReport(int(flat.nbytes), io_path, tier_key, seconds)
