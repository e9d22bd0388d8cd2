"""Tier roots: opening files beneath a root without following symlinks, space, and walking.

Paths are never checked and then reopened. Every open walks from the root's directory fd one
component at a time with ``O_NOFOLLOW``, so a symlink inside a tier (or one swapped in
mid-request) can never lead outside it; the caller serves from the fd it got.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tiering.config import TierConfig
from tiering.errors import FileNotFound, InvalidPath, TierNotFound
from tiering.tiers.paths import is_temp_name, split_relpath, validate_relpath

__all__ = ["Space", "Tier", "Tiers", "WalkEntry"]

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Space:
    total: int
    used: int
    free: int


@dataclass(frozen=True)
class WalkEntry:
    relpath: str
    size: int
    mtime_ns: int
    dev: int
    ino: int


def _beneath_error(exc: OSError, relpath: str) -> Exception:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return InvalidPath(f"path {relpath!r} crosses a symlink or a non-directory")
    if exc.errno == errno.ENOENT:
        return FileNotFound(f"no file at path {relpath!r} on disk", path=relpath)
    return exc


class Tier:
    """One tier root. ``rank`` 0 is the fastest."""

    def __init__(self, config: TierConfig, rank: int) -> None:
        self.name = config.name
        self.root = Path(config.path)
        self.quota_bytes = config.quota_bytes
        self.rank = rank

    def __repr__(self) -> str:
        return f"Tier({self.name!r}, {str(self.root)!r}, rank={self.rank})"

    def ensure_root(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def space(self) -> Space:
        du = shutil.disk_usage(self.root)
        return Space(du.total, du.used, du.free)

    # -- opening beneath the root ------------------------------------------------------------
    def open_dir(self, parts: list[str], *, create: bool = False) -> int:
        """An fd of the directory ``parts`` beneath the root, walked without following links.

        With ``create``, missing directories are made and each new entry is fsynced into its
        parent, so a published file's directory survives a crash too.
        """
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            walked: list[str] = []
            for part in parts:
                walked.append(part)
                try:
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                        os.fsync(fd)
                    except FileExistsError:
                        pass
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nfd
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                where = "/".join(walked)
                raise InvalidPath(f"{where!r} is a symlink or not a directory") from exc
            raise
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_read(self, relpath: str) -> tuple[int, os.stat_result]:
        """Open a regular file for reading; returns the fd and its ``fstat``."""
        dirs, name = split_relpath(relpath)
        try:
            dfd = self.open_dir(dirs)
        except OSError as exc:
            raise _beneath_error(exc, relpath) from exc
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
        except OSError as exc:
            raise _beneath_error(exc, relpath) from exc
        finally:
            os.close(dfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise InvalidPath(f"path {relpath!r} is not a regular file")
        return fd, st

    def stat(self, relpath: str) -> os.stat_result | None:
        """``lstat`` of a regular file beneath the root, or None when it is not there."""
        try:
            fd, st = self.open_read(relpath)
        except (FileNotFound, InvalidPath):
            return None
        os.close(fd)
        return st

    def unlink(self, relpath: str, *, name: str | None = None) -> bool:
        """Remove a file and fsync its directory; False when it was already gone.

        With ``name``, remove that entry of ``relpath``'s directory instead (a temp file).
        """
        dirs, own = split_relpath(relpath)
        name = name or own
        try:
            dfd = self.open_dir(dirs)
        except OSError:
            return False
        try:
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                return False
            os.fsync(dfd)
            return True
        finally:
            os.close(dfd)

    # -- walking -----------------------------------------------------------------------------
    def walk(self) -> Iterator[WalkEntry]:
        """Every regular file under the root, skipping symlinks and tierd's temp files."""
        stack = [""]
        while stack:
            prefix = stack.pop()
            try:
                it = os.scandir(self.root / prefix if prefix else self.root)
            except OSError as exc:
                log.warning("cannot list %s in tier %s: %s", prefix or "/", self.name, exc)
                continue
            with it:
                for entry in it:
                    rel = f"{prefix}/{entry.name}" if prefix else entry.name
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(rel)
                        continue
                    if not entry.is_file(follow_symlinks=False) or is_temp_name(entry.name):
                        continue
                    try:
                        validate_relpath(rel)
                        st = entry.stat(follow_symlinks=False)
                    except (InvalidPath, OSError) as exc:
                        log.warning("skipping %r in tier %s: %s", rel, self.name, exc)
                        continue
                    yield WalkEntry(rel, st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino)

    def temp_files(self) -> Iterator[str]:
        """Relpaths of tierd's own temp files under the root (for recovery)."""
        for dirpath, _dirs, files in os.walk(self.root, followlinks=False):
            for name in files:
                if is_temp_name(name):
                    yield os.path.relpath(os.path.join(dirpath, name), self.root)


class Tiers:
    """The ordered tiers of one engine."""

    def __init__(self, configs: tuple[TierConfig, ...] | list[TierConfig]) -> None:
        names = [c.name for c in configs]
        if not configs:
            raise ValueError("at least one tier is required")
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique: {names}")
        self._tiers = [Tier(c, rank) for rank, c in enumerate(configs)]
        self._by_name = {t.name: t for t in self._tiers}

    def __iter__(self) -> Iterator[Tier]:
        return iter(self._tiers)

    def __len__(self) -> int:
        return len(self._tiers)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str) -> Tier:
        try:
            return self._by_name[name]
        except KeyError:
            raise TierNotFound(
                f"no tier named {name!r}; tiers are {', '.join(self._by_name)}", tier=name
            ) from None

    @property
    def fastest(self) -> Tier:
        return self._tiers[0]
