"""Directory tiers: a local root. Files are opened beneath it without following symlinks.

Paths are never checked and then reopened. Every open walks from the root's directory fd one
component at a time with ``O_NOFOLLOW``, so a symlink inside a tier (or one swapped in
mid-request) can never lead outside it; the caller serves from the fd it got.

Kept whole past 450 lines: every primitive of a directory tier walks from the root's fd with the
same helpers (no path checked, then reopened).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tiering.codec import FOOTER, HEADER, Container, CorruptContainer
from tiering.config import TierConfig
from tiering.errors import FileNotFound, InvalidPath, TierUnavailable
from tiering.ranges import RangeReader, Rings, read_ahead
from tiering.tiers._base import (
    Capabilities,
    LocalFile,
    Source,
    Space,
    Stat,
    Tier,
    WalkEntry,
    Writer,
)
from tiering.tiers._compressed import (
    CompressedRanges,
    CompressingWriter,
    logical_stat,
    sniff,
)
from tiering.tiers._dirwriter import DirectoryWriter, pread_exact, stat_of
from tiering.tiers.paths import (
    RESERVED_DIR,
    TEMP_SUFFIX,
    is_temp_name,
    split_relpath,
    validate_relpath,
)

__all__ = ["CompressedSource", "DirectorySource", "DirectoryTier"]

#: ``compression = "auto"`` compresses on directory tiers of this rank and slower: the third
#: tier on (an HDD or a network mount in the default nvme/ssd/hdd layout). A CPU decodes a
#: compressed bf16 file at about 0.5-1 GB/s a core, slower than an SSD reads it raw, faster
#: than an HDD reads it.
AUTO_COMPRESS_RANK = 2

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def _beneath_error(exc: OSError, relpath: str) -> Exception:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return InvalidPath(f"path {relpath!r} crosses a symlink or a non-directory")
    if exc.errno == errno.ENOENT:
        return FileNotFound(f"no file at path {relpath!r} on disk", path=relpath)
    return exc


def _sort_key(entry: os.DirEntry[str]) -> str:
    """A directory sorts as its name and ``/``, where the relpaths of its files do."""
    return entry.name + "/" if entry.is_dir(follow_symlinks=False) else entry.name


class DirectorySource(Source):
    """A file opened beneath a directory tier; reads go through its fd."""

    def __init__(self, tier: DirectoryTier, relpath: str, fd: int, st: os.stat_result) -> None:
        self.tier = tier
        self.relpath = relpath
        self.fd = fd
        self.st = st
        self.disk = self.stat = stat_of(st)  # the file on disk (a compressed one's differs)

    def local_file(self) -> LocalFile | None:
        return LocalFile(self.fd, self.tier.root / self.relpath) if self.fd >= 0 else None

    def readinto(self, buf: memoryview, offset: int) -> int:
        return self._pread_into(buf, offset)

    def _pread_into(self, view: memoryview, offset: int) -> int:
        """The file's bytes at ``offset`` into ``view`` (fewer only at its end)."""
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                break
            done += got
        return done

    def chunks(self, chunk_size: int) -> Iterator[memoryview]:
        with contextlib.suppress(OSError):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return super().chunks(chunk_size)

    def unchanged(self) -> bool:
        """The fd's file is unchanged and the path still names it."""
        if self.fd < 0:
            return False
        now = stat_of(os.fstat(self.fd))
        at_path = self.tier.lstat(self.relpath)
        return now.same_file(self.disk) and at_path is not None and at_path.same_file(self.disk)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class CompressedSource(DirectorySource):
    """A container beneath a directory tier, read as its logical bytes (see
    :mod:`tiering.tiers._compressed`): no local file, a decoding range reader."""

    def __init__(
        self, tier: DirectoryTier, relpath: str, fd: int, st: os.stat_result, c: Container
    ) -> None:
        super().__init__(tier, relpath, fd, st)
        # Chunks are read through the source's fd as it is at each read: once the source is
        # closed a late read fails (EBADF) rather than read whatever file took the number.
        self.container = c.reading(self._pread, self._pread_into)
        self.stat = logical_stat(self.disk, c.size)
        self._ranges = CompressedRanges(self.container, self.disk.version, tier.decode_pool())

    def local_file(self) -> LocalFile | None:
        return None

    @property
    def ranges(self) -> RangeReader | None:
        return self._ranges

    def readinto(self, buf: memoryview, offset: int) -> int:
        return self.container.readinto(buf, offset)

    def _pread(self, n: int, offset: int) -> bytes:
        return pread_exact(self.fd, n, offset)

    def chunks(self, chunk_size: int) -> Iterator[memoryview]:
        """In order, with the next chunks decoding on the tier's pool meanwhile (a move or a
        memory fill writes one while the cores decode the next)."""
        ahead = min(os.cpu_count() or 1, 4) * self.container.chunk_size
        return read_ahead(self._ranges, chunk_size, readahead_bytes=ahead, rings=Rings(0))


class DirectoryTier(Tier):
    """A tier rooted at a local directory.

    ``compresses``: the files it writes are stored compressed where that pays (its
    ``compression`` setting: ``"on"``, ``"off"``, or ``"auto"``: on from
    :data:`AUTO_COMPRESS_RANK`). It reads the compressed files it holds whatever the setting.
    """

    kind = "directory"
    capabilities = Capabilities(holds_copies=True, local_files=True, direct_gpu=True)

    def __init__(self, config: TierConfig, rank: int) -> None:
        super().__init__(config, rank)
        if config.path is None:
            raise ValueError(f"tier {config.name!r} is a directory tier and needs a path")
        self.root = Path(config.path)
        self._copies: DirectoryTier | None = None
        mode = config.compression
        self.compresses = mode == "on" or (mode == "auto" and rank >= AUTO_COMPRESS_RANK)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def decode_pool(self) -> ThreadPoolExecutor:
        """The threads that decode compressed files' chunks (made at the first one)."""
        with self._pool_lock:
            if self._pool is None:
                name = f"tierd-decode-{self.name}"
                self._pool = ThreadPoolExecutor(os.cpu_count() or 1, name)
            return self._pool

    def close(self) -> None:
        if self._copies is not None:
            self._copies.close()
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    @property
    def location(self) -> str:
        return str(self.root)

    @property
    def local_root(self) -> Path:
        """The root (this backend's own; callers elsewhere ask :attr:`capabilities`)."""
        return self.root

    def watch_root(self) -> Path:
        return self.root

    def copies(self) -> DirectoryTier:
        """The reserved directory ``.tierd-copies`` beneath the root (which :meth:`walk` and
        :meth:`temps` skip), as a directory tier: copies are written, published, opened and
        swept through its primitives like any file."""
        if self._copies is None:
            # Copies are filled piece by piece (positional writes): never compressed.
            cfg = TierConfig(self.name, path=self.root / RESERVED_DIR, compression="off")
            self._copies = DirectoryTier(cfg, self.rank)
        return self._copies

    def check(self) -> None:
        """Create the root (durably: its entry is fsynced into its parent) and check that this
        process may use it."""
        try:
            if not self.root.is_dir():
                self.root.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as exc:
            raise TierUnavailable(
                f"tier {self.name}: cannot create its directory {self.root}: {exc.strerror}",
                tier=self.name,
            ) from exc
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise TierUnavailable(
                f"tier {self.name}: its directory {self.root} is not readable and writable "
                "by this process",
                tier=self.name,
            )

    def reachable(self) -> bool:
        return self.root.is_dir() and os.access(self.root, os.R_OK | os.W_OK | os.X_OK)

    def space(self) -> Space:
        du = shutil.disk_usage(self.root)
        return Space(du.total, du.used, du.free)

    # -- opening beneath the root ------------------------------------------------------------
    def open_dir(
        self, parts: list[str], *, create: bool = False, made: list[str] | None = None
    ) -> int:
        """An fd of the directory ``parts`` beneath the root, walked without following links.

        With ``create``, missing directories are made and each new entry is fsynced into its
        parent, so a published file's directory survives a crash too. ``made`` gets the relpath
        of each directory this call made, so a writer that aborts can take them back.
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
                        if made is not None:
                            made.append("/".join(walked))
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

    def open(
        self, relpath: str, *, etag: str | None = None, known: Stat | None = None
    ) -> DirectorySource:
        fd, st = self.open_read(relpath)
        try:
            c = sniff(fd, st.st_size, relpath)
        except BaseException:
            os.close(fd)
            raise
        if c is None:
            return DirectorySource(self, relpath, fd, st)
        return CompressedSource(self, relpath, fd, st, c)

    def stat(self, relpath: str) -> Stat | None:
        """The regular file beneath the root (opened, never followed), or None; a compressed
        one's logical size."""
        try:
            fd, st = self.open_read(relpath)
        except (FileNotFound, InvalidPath):
            return None
        try:
            c = sniff(fd, st.st_size, relpath)
        finally:
            os.close(fd)
        return stat_of(st) if c is None else logical_stat(stat_of(st), c.size)

    def lstat(self, relpath: str) -> Stat | None:
        """``lstat`` of the name ``relpath``: None if absent or not a regular file."""
        dirs, name = split_relpath(relpath)
        try:
            dfd = self.open_dir(dirs)
        except OSError:
            return None
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        finally:
            os.close(dfd)
        return stat_of(st) if stat.S_ISREG(st.st_mode) else None

    def writer(
        self,
        relpath: str,
        *,
        overwrite: bool = False,
        limit: int | None = None,
        temp_stem: str | None = None,
        checksum: str | None = None,
    ) -> Writer:
        if not self.compresses:
            return DirectoryWriter(
                self,
                relpath,
                overwrite=overwrite,
                limit=limit,
                temp_stem=temp_stem,
                checksum=checksum,
            )
        inner = DirectoryWriter(
            self, relpath, overwrite=overwrite, limit=limit, temp_stem=temp_stem
        )
        return CompressingWriter(
            self, relpath, checksum, inner, room=inner.check_room, read_back=True
        )

    def remove(
        self,
        relpath: str,
        *,
        version: str | None = None,
        between: Callable[[], None] | None = None,
    ) -> bool:
        """Unlink and fsync the directory; with ``version``, only if it is still that inode."""
        dirs, name = split_relpath(relpath)
        try:
            dfd = self.open_dir(dirs)
        except OSError:
            return False
        try:
            if version is not None:
                try:
                    cur = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    return False
                if f"{cur.st_dev}:{cur.st_ino}" != version:
                    log.warning(
                        "not removing %r on tier %s: it is not the file that was moved",
                        relpath,
                        self.name,
                    )
                    return False
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                return False
            if between is not None:
                between()
            os.fsync(dfd)
            return True
        finally:
            os.close(dfd)

    def remove_temp(self, relpath: str, temp_stem: str) -> bool:
        """Unlink the temp file ``.<temp_stem>.tierd-tmp`` in ``relpath``'s directory."""
        dirs, _ = split_relpath(relpath)
        try:
            dfd = self.open_dir(dirs)
        except OSError:
            return False
        try:
            try:
                os.unlink(f".{temp_stem}{TEMP_SUFFIX}", dir_fd=dfd)
            except FileNotFoundError:
                return False
            os.fsync(dfd)
            return True
        finally:
            os.close(dfd)

    # -- walking -----------------------------------------------------------------------------
    def walk(self) -> Iterator[WalkEntry]:
        """Every regular file under the root in relpath order, skipping symlinks, tierd's temp
        files and its reserved copies directory (cached copies, not files of the tier).

        One directory's entries are listed and sorted at a time (a directory sorts by its name
        and ``/``, so its files come where their relpaths do); the walk holds only those of
        the directories it is inside.
        """
        return self._walk_dir("")

    def _walk_dir(self, prefix: str) -> Iterator[WalkEntry]:
        try:
            with os.scandir(self.root / prefix if prefix else self.root) as it:
                listed = [(_sort_key(e), e) for e in it]
        except OSError as exc:
            log.warning("cannot list %s in tier %s: %s", prefix or "/", self.name, exc)
            return
        listed.sort(key=lambda ke: ke[0])
        for key, entry in listed:
            rel = f"{prefix}/{entry.name}" if prefix else entry.name
            if key.endswith("/"):
                if rel != RESERVED_DIR:
                    yield from self._walk_dir(rel)
                continue
            if not entry.is_file(follow_symlinks=False) or is_temp_name(entry.name):
                continue
            try:
                validate_relpath(rel)
                st = entry.stat(follow_symlinks=False)
                size = self._logical_size(rel, st.st_size)
            except (InvalidPath, OSError) as exc:
                log.warning("skipping %r in tier %s: %s", rel, self.name, exc)
                continue
            yield WalkEntry(rel, size, st.st_mtime_ns, st.st_dev, st.st_ino)

    def _logical_size(self, relpath: str, size: int) -> int:
        """The size of the file the stored one is: a compressed file's logical size."""
        if size < HEADER + FOOTER:
            return size
        # By path, as the walk's own stat: this only reports a size (a read serves what
        # open() found, walked beneath the root).
        try:
            fd = os.open(self.root / relpath, _READ_FLAGS)
        except OSError:
            return size
        try:
            c = sniff(fd, size, relpath)
        except CorruptContainer as exc:
            log.warning("%s in tier %s: %s", relpath, self.name, exc)
            return size
        finally:
            os.close(fd)
        return size if c is None else c.size

    def temps(self) -> Iterator[tuple[str, str]]:
        """``(relpath, stem)`` of tierd's temp files under the root.

        ``relpath`` names a file in the temp's directory (the final name is not recorded in a
        temp's name), which is all :meth:`remove_temp` needs.
        """
        for dirpath, dirs, files in os.walk(self.root, followlinks=False):
            if dirpath == str(self.root) and RESERVED_DIR in dirs:
                # Its temps are the host copies' (their reconcile removes them); a path in it
                # is no relpath, so remove_temp could not name them anyway.
                dirs.remove(RESERVED_DIR)
            for name in files:
                if is_temp_name(name):
                    rel = os.path.relpath(dirpath, self.root)
                    stem = name[1 : -len(TEMP_SUFFIX)]
                    yield (stem if rel == "." else f"{rel}/{stem}"), stem
