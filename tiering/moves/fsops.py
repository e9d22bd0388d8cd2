"""Crash-safe file operations: temp file in the final directory, fsync, no-clobber publish,
dir fsync; and the guarded removals a move and its recovery make.

Every byte tierd writes into a tier goes through :class:`AtomicWriter`, and every file a move
removes goes through :func:`unlink_if_same` or :func:`unlink_published`, so the durability rules
of RELIABILITY.md live in one place and fault tests have one place to aim at. File operations
are called as ``os.<name>`` at call time so tests can patch ``os`` functions to inject faults.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from tiering.checksum import Hasher, hash_fd
from tiering.errors import AlreadyExists, FileNotFound, InsufficientSpace, InvalidPath, TierdError
from tiering.tiers import Tier
from tiering.tiers.paths import TEMP_SUFFIX, split_relpath

__all__ = [
    "AtomicWriter",
    "Published",
    "identity",
    "lstat_file",
    "probe",
    "unlink_if_same",
    "unlink_published",
    "write_all",
]

log = logging.getLogger(__name__)

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class Published:
    relpath: str
    size: int
    mtime_ns: int
    checksum: str
    dev: int = 0
    ino: int = 0


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until every byte is written (short writes happen on some filesystems)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class AtomicWriter:
    """Write one file into a tier so that readers and crashes only ever see old or new bytes.

    Use as a context manager: leaving the block without :meth:`publish` removes the temp file.

    Parameters
    ----------
    tier, relpath:
        Where the file will be published.
    overwrite:
        Replace an existing file atomically (``rename``); otherwise publishing onto an existing
        name raises :class:`AlreadyExists` and leaves both files alone (``link``).
    limit:
        Most bytes accepted; a write past it raises :class:`InsufficientSpace` (quota).
    temp_stem:
        Distinguishes temp names (``.<stem>.tierd-tmp``); random when not given.
    """

    def __init__(
        self,
        tier: Tier,
        relpath: str,
        *,
        overwrite: bool = False,
        limit: int | None = None,
        temp_stem: str | None = None,
    ) -> None:
        self.tier = tier
        self.relpath = relpath
        self.overwrite = overwrite
        self.limit = limit
        dirs, self.name = split_relpath(relpath)
        self.temp_name = f".{temp_stem or 'w-' + secrets.token_hex(8)}{TEMP_SUFFIX}"
        self.size = 0
        self._hasher = Hasher()
        self._dirfd = tier.open_dir(dirs, create=True)
        self._fd: int | None = None
        self._synced: os.stat_result | None = None
        try:
            if not overwrite and self._exists():
                raise AlreadyExists(
                    f"{relpath!r} already exists in tier {tier.name}; pass overwrite=true",
                    path=relpath,
                )
            self._fd = os.open(
                self.temp_name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=self._dirfd,
            )
        except BaseException:
            os.close(self._dirfd)
            raise

    def _exists(self) -> bool:
        try:
            os.stat(self.name, dir_fd=self._dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()

    @property
    def checksum(self) -> str:
        """Checksum of the bytes written so far."""
        return self._hasher.value()

    @property
    def synced(self) -> os.stat_result | None:
        """The temp file's ``fstat`` once :meth:`sync` succeeded, else None.

        After a failed :meth:`publish` a caller uses it to tell whether the name now at the
        final path is this writer's inode (``link`` done, directory fsync failed).
        """
        return self._synced

    def write(self, data: bytes | memoryview) -> None:
        if self._fd is None:
            raise TierdError("write after publish or abort")
        if self.limit is not None and self.size + len(data) > self.limit:
            raise InsufficientSpace(
                f"tier {self.tier.name} has room for {self.limit} more bytes only",
                tier=self.tier.name,
                limit=self.limit,
            )
        try:
            write_all(self._fd, data)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise InsufficientSpace(
                    f"tier {self.tier.name} is out of space", tier=self.tier.name
                ) from exc
            raise
        self._hasher.update(data)
        self.size += len(data)

    def sync(
        self, *, mode: int | None = None, times_ns: tuple[int, int] | None = None
    ) -> os.stat_result:
        """fsync the temp file (after setting its mode and times, when given); idempotent.

        A failed fsync may have dropped the dirty pages already, so it is never retried: the
        temp is discarded and the error raised.
        """
        if self._synced is not None:
            return self._synced
        if self._fd is None:
            raise TierdError("sync after publish or abort")
        try:
            if mode is not None:
                os.fchmod(self._fd, mode)
            if times_ns is not None:
                os.utime(self._fd, ns=times_ns)
            os.fsync(self._fd)
            self._synced = os.fstat(self._fd)
        except BaseException:
            fd, self._fd = self._fd, None
            os.close(fd)
            self._unlink_temp()
            raise
        return self._synced

    def publish(self) -> Published:
        """fsync, publish under the final name without clobbering, fsync the directory."""
        if self._fd is None:
            raise TierdError("publish after publish or abort")
        st = self.sync()
        fd, self._fd = self._fd, None
        os.close(fd)
        try:
            if self.overwrite:
                os.rename(self.temp_name, self.name, src_dir_fd=self._dirfd, dst_dir_fd=self._dirfd)
            else:
                try:
                    os.link(
                        self.temp_name,
                        self.name,
                        src_dir_fd=self._dirfd,
                        dst_dir_fd=self._dirfd,
                        follow_symlinks=False,
                    )
                except FileExistsError:
                    raise AlreadyExists(
                        f"{self.relpath!r} appeared in tier {self.tier.name} during the write",
                        path=self.relpath,
                    ) from None
                os.unlink(self.temp_name, dir_fd=self._dirfd)
            os.fsync(self._dirfd)
        except BaseException:
            self._unlink_temp()
            raise
        finally:
            self._close_dir()
        return Published(
            self.relpath, self.size, st.st_mtime_ns, self._hasher.value(), st.st_dev, st.st_ino
        )

    def abort(self) -> None:
        """Discard the temp file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._unlink_temp()
        self._close_dir()

    def _unlink_temp(self) -> None:
        if self._dirfd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temp_name, dir_fd=self._dirfd)

    def _close_dir(self) -> None:
        if self._dirfd >= 0:
            os.close(self._dirfd)
            self._dirfd = -1


# -- guarded removals: a move and its recovery delete only what they can prove is theirs ------
def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What makes two stats "the same file, unchanged": device, inode, size and mtime."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def lstat_file(tier: Tier, relpath: str) -> os.stat_result | None:
    """``lstat`` of the regular file at ``relpath`` on ``tier``; None if absent or not regular."""
    dirs, name = split_relpath(relpath)
    try:
        dfd = tier.open_dir(dirs)
    except OSError:
        return None
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    finally:
        os.close(dfd)
    return st if stat.S_ISREG(st.st_mode) else None


def unlink_if_same(
    tier: Tier,
    relpath: str,
    st: os.stat_result,
    between: Callable[[], None] | None = None,
) -> bool:
    """Unlink ``relpath`` and fsync its directory, only if it is the inode ``st``.

    ``between`` runs after the unlink and before the directory fsync (a test hook's step).
    Returns False, removing nothing, when the name is gone or now names another file.
    """
    dirs, name = split_relpath(relpath)
    try:
        dfd = tier.open_dir(dirs)
    except OSError:
        return False
    try:
        try:
            cur = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (cur.st_dev, cur.st_ino) != (st.st_dev, st.st_ino):
            log.warning(
                "not removing %r on tier %s: it is not the file that was moved",
                relpath,
                tier.name,
            )
            return False
        os.unlink(name, dir_fd=dfd)
        if between is not None:
            between()
        os.fsync(dfd)
        return True
    finally:
        os.close(dfd)


def unlink_published(tier: Tier, relpath: str, pub: Published) -> None:
    """Remove an aborted move's published copy, if ``relpath`` is still that inode.

    Runs while an abort is already under way, so a failure is logged, not raised: the abort
    must still be recorded, and the source is untouched either way.
    """
    try:
        dirs, name = split_relpath(relpath)
        dfd = tier.open_dir(dirs)
        try:
            cur = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if (cur.st_dev, cur.st_ino) == (pub.dev, pub.ino):
                os.unlink(name, dir_fd=dfd)
                os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        log.error("could not remove the aborted copy of %r on %s: %s", relpath, tier.name, exc)


def probe(tier: Tier, relpath: str) -> tuple[str, os.stat_result] | None:
    """Checksum and stat of the regular file at ``relpath`` on ``tier``, or None."""
    try:
        fd, st = tier.open_read(relpath)
    except (FileNotFound, InvalidPath):
        return None
    try:
        return hash_fd(fd), st
    finally:
        os.close(fd)
