"""Writing into a directory tier: a temp file in the final directory, fsync, a no-clobber
publish (``link``) or an atomic replace (``rename``), then an fsync of the directory.

Every byte tierd writes into a directory tier goes through :class:`DirectoryWriter`, so the
durability rules of RELIABILITY.md live in one place and fault tests have one place to aim at.
File operations are called as ``os.<name>`` at call time so tests can patch ``os`` functions to
inject faults.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, cast

from tiering.errors import AlreadyExists, InsufficientSpace, TierdError
from tiering.tiers._base import Published, Stat, Tier, Writer
from tiering.tiers._writeback import WRITEBACK_STEP, start_writeback
from tiering.tiers.paths import TEMP_SUFFIX, split_relpath


class _Root(Protocol):
    """What a writer needs of its directory tier (a Protocol: the tier module imports this one)."""

    root: Path

    def open_dir(
        self, parts: list[str], *, create: bool = False, made: list[str] | None = None
    ) -> int: ...

    def _lstat_here(self, relpath: str) -> Stat | None: ...

    def _remove_here(
        self, relpath: str, version: str | None, between: Callable[[], None] | None
    ) -> bool | None: ...


__all__ = ["DirectoryWriter", "check_room", "stat_of", "write_all"]

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def stat_of(st: os.stat_result) -> Stat:
    """A :class:`Stat` of a local file; its version is the inode."""
    return Stat(
        st.st_size,
        st.st_mtime_ns,
        f"{st.st_dev}:{st.st_ino}",
        mode=st.st_mode & 0o7777,
        atime_ns=st.st_atime_ns,
    )


def check_room(tier: str, limit: int | None, end: int) -> None:
    """Refuse a write that would take a file of ``tier`` past ``limit`` bytes."""
    if limit is not None and end > limit:
        raise InsufficientSpace(
            f"tier {tier} has room for {limit} more bytes only", tier=tier, limit=limit
        )


def pread_exact(fd: int, n: int, offset: int) -> bytes:
    """``n`` bytes at ``offset`` (fewer only at the end of the file)."""
    parts = []
    while n > 0:
        b = os.pread(fd, n, offset)
        if not b:
            break
        parts.append(b)
        n -= len(b)
        offset += len(b)
    return b"".join(parts)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until every byte is written (short writes happen on some filesystems)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class DirectoryWriter(Writer):
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
    checksum:
        The checksum the bytes must have: :meth:`publish` refuses others with
        :class:`IntegrityError` and removes the temp. (A directory keeps no metadata to store
        it in; the catalog holds it.)
    beside:
        The tier's other place for the same relpath (its plain root, or its
        ``.tierd-compressed`` directory), where the file may be in its other form: without
        ``overwrite`` a file there is :class:`AlreadyExists` too; with it, that form is
        removed once this one is published (a crash between leaves both: the newer is the
        file, see :meth:`DirectoryTier.open`).
    """

    def __init__(
        self,
        tier: Tier,
        relpath: str,
        *,
        overwrite: bool = False,
        limit: int | None = None,
        temp_stem: str | None = None,
        checksum: str | None = None,
        beside: _Root | None = None,
    ) -> None:
        self.tier = tier
        self.relpath = relpath
        self.beside = beside
        self.overwrite = overwrite
        self.limit = limit
        self.expected = checksum
        dirs, self.name = split_relpath(relpath)
        self.temp_name = f".{temp_stem or 'w-' + secrets.token_hex(8)}{TEMP_SUFFIX}"
        self.size = 0
        self._written_back = 0  # bytes handed to start_writeback so far
        from tiering.checksum import Hasher  # xxhash: the client imports tiers without it

        self._hasher = Hasher()
        self._outside: str | None = None  # the checksum of bytes written outside (a process)
        # write_at: pieces land out of order, so the checksum is of the file at the end.
        self._positional = False
        self._at_lock = threading.Lock()
        # The directories made for this file: an abort removes them again (when still empty),
        # so a failed or cut-short upload leaves nothing on the tier.
        self._made: list[str] = []
        self._dirfd = cast(_Root, tier).open_dir(dirs, create=True, made=self._made)
        self._fd: int | None = None
        self._synced: os.stat_result | None = None
        try:
            existing = self._stat()
            if existing is not None and stat.S_ISDIR(existing.st_mode):
                # Publishing would rename over a directory (EISDIR): a conflict, not an I/O error.
                raise AlreadyExists(
                    f"{relpath!r} is a directory in tier {tier.name}; a file cannot replace it",
                    path=relpath,
                )
            if not overwrite and (existing is not None or self._beside_holds()):
                raise AlreadyExists(
                    f"{relpath!r} already exists in tier {tier.name}; pass overwrite=true",
                    path=relpath,
                )
            self._fd = os.open(
                self.temp_name,
                # Read too: a fill relays pieces from its temp (read_at) before it publishes.
                os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=self._dirfd,
            )
        except BaseException:
            os.close(self._dirfd)
            self._dirfd = -1
            self._remove_made()
            raise

    def _beside_holds(self) -> bool:
        return self.beside is not None and self.beside._lstat_here(self.relpath) is not None

    def _stat(self) -> os.stat_result | None:
        try:
            return os.stat(self.name, dir_fd=self._dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    @property
    def checksum(self) -> str:
        """Checksum of the bytes written so far."""
        if self._positional and self._fd is not None:
            from tiering.checksum import hash_fd

            return hash_fd(self._fd, self.size)
        return self._outside or self._hasher.value()

    @property
    def synced(self) -> Stat | None:
        """The temp file's ``fstat`` once :meth:`sync` succeeded, else None.

        After a failed :meth:`publish` a caller uses it to tell whether the name now at the
        final path is this writer's inode (``link`` done, directory fsync failed).
        """
        return None if self._synced is None else stat_of(self._synced)

    def check_room(self, end: int) -> None:
        """Refuse a write that would take the file past ``limit`` bytes."""
        check_room(self.tier.name, self.limit, end)

    @contextlib.contextmanager
    def _space(self) -> Iterator[None]:
        """A full disk (ENOSPC, EDQUOT) as :class:`InsufficientSpace` naming the tier."""
        try:
            yield
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise InsufficientSpace(
                    f"tier {self.tier.name} is out of space", tier=self.tier.name
                ) from exc
            raise

    def write(self, data: bytes | memoryview) -> None:
        if self._fd is None:
            raise TierdError("write after publish or abort")
        if self._positional:
            raise TierdError("write after write_at: a writer takes one or the other")
        self.check_room(self.size + len(data))
        with self._space():
            write_all(self._fd, data)
        self._hasher.update(data)
        self.size += len(data)
        if self.size - self._written_back >= WRITEBACK_STEP:
            start_writeback(self._fd, self._written_back, self.size - self._written_back)
            self._written_back = self.size

    def local_fd(self) -> int | None:
        if self._fd is None or self.size or self._positional:
            return None
        return self._fd

    def written_outside(self, size: int, checksum: str) -> None:
        if self.local_fd() is None:
            raise TierdError("bytes written outside a writer that was written or closed")
        self.check_room(size)
        self.size, self._outside = size, checksum

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        """``pwrite`` at ``offset`` (thread-safe); see :meth:`Writer.write_at`."""
        fd = self._fd
        if fd is None:
            raise TierdError("write after publish or abort")
        with self._at_lock:
            if self.size and not self._positional:
                raise TierdError("write_at after write: a writer takes one or the other")
            self._positional = True
        end = offset + len(data)
        self.check_room(end)
        view = memoryview(data)
        with self._space():
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
        with self._at_lock:
            self.size = max(self.size, end)

    def read_at(self, offset: int, length: int) -> bytes:
        fd = self._fd
        if fd is None:
            raise TierdError("read after publish or abort")
        out = bytearray()
        while len(out) < length:
            chunk = os.pread(fd, length - len(out), offset + len(out))
            if not chunk:
                break
            out += chunk
        return bytes(out)

    def sync(self, *, mode: int | None = None, times_ns: tuple[int, int] | None = None) -> Stat:
        """fsync the temp file (after setting its mode and times, when given); idempotent.

        A failed fsync may have dropped the dirty pages already, so it is never retried: the
        temp is discarded and the error raised.
        """
        if self._synced is not None:
            return stat_of(self._synced)
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
        return stat_of(self._synced)

    def publish(self) -> Published:
        """fsync, publish under the final name without clobbering, fsync the directory."""
        if self._fd is None:
            raise TierdError("publish after publish or abort")
        value = self.refuse_unexpected()
        st = self.sync()
        fd, self._fd = self._fd, None
        os.close(fd)
        try:
            if self.overwrite:
                os.rename(self.temp_name, self.name, src_dir_fd=self._dirfd, dst_dir_fd=self._dirfd)
            else:
                if self._beside_holds():
                    raise AlreadyExists(
                        f"{self.relpath!r} appeared in tier {self.tier.name} during the write",
                        path=self.relpath,
                    )
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
        self._made = []  # they hold the file now
        if self.overwrite and self.beside is not None:
            self.beside._remove_here(self.relpath, None, None)  # the old form, if any
        return Published(self.relpath, self.size, st.mtime_ns, value, st)

    def abort(self) -> None:
        """Discard the temp file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._unlink_temp()
        self._close_dir()
        self._remove_made()

    def _remove_made(self) -> None:
        """Remove the directories this writer made, deepest first, while they are empty."""
        made, self._made = self._made, []
        if not made:
            return
        root = os.open(cast(_Root, self.tier).root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for rel in reversed(made):
                try:
                    os.rmdir(rel, dir_fd=root)
                except OSError:
                    return  # another file landed there meanwhile: it and its parents stay
        finally:
            os.close(root)

    def _unlink_temp(self) -> None:
        if self._dirfd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temp_name, dir_fd=self._dirfd)

    def _close_dir(self) -> None:
        if self._dirfd >= 0:
            os.close(self._dirfd)
            self._dirfd = -1
