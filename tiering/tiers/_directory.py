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
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from tiering.codec import CODEC, MAGIC, Container
from tiering.config import TierConfig
from tiering.errors import AlreadyExists, FileNotFound, InvalidPath, TierUnavailable
from tiering.tiers._base import Capabilities, Space, Stat, Tier, WalkEntry, Writer
from tiering.tiers._compressed import CompressingWriter, merged_walk
from tiering.tiers._dirsource import CompressedSource, DirectorySource
from tiering.tiers._dirwalk import temps_under, walk_dir
from tiering.tiers._dirwriter import DirectoryWriter, check_room, pread_exact, stat_of
from tiering.tiers.paths import (
    COMPRESSED_DIR,
    RESERVED_DIR,
    TEMP_SUFFIX,
    split_relpath,
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
        self._packed: DirectoryTier | None = None
        self._has_packed = True  # False for the reserved areas' own directory tiers
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
            self._copies._has_packed = False
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
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                raise
            # A place made with its first file (.tierd-compressed), durably; an error is the
            # writer's to report (a full or failing disk), not the tier's unavailability.
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.root, 0o755)
            parent = os.open(self.root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(parent)
            finally:
                os.close(parent)
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

    def places(self) -> tuple[DirectoryTier, ...]:
        """The directories that hold this tier's files: the root, and (a tier's own, not a
        reserved area's) its ``.tierd-compressed`` directory of containers, as a directory tier.

        Where a file is says what it is: only a file under ``.tierd-compressed`` is read as a
        container. A user's file that begins with the container's magic is bytes like any
        other, whatever tier it is on (tierd never takes the first bytes of a file it did not
        write for a format).
        """
        if not self._has_packed:
            return (self,)
        if self._packed is None:
            cfg = TierConfig(self.name, path=self.root / COMPRESSED_DIR, compression="off")
            packed = DirectoryTier(cfg, self.rank)
            packed._has_packed = False
            self._packed = packed
        return (self, self._packed)

    def _found(self, relpath: str) -> tuple[DirectoryTier, int, os.stat_result] | None:
        """The place holding ``relpath``, with an fd and ``fstat``; None where none does.

        At both places (an overwrite that changed the file's form stopped before it removed the
        old one) the newer is the file, as in :func:`~tiering.tiers._compressed.one_per_relpath`.
        """
        best: tuple[DirectoryTier, int, os.stat_result] | None = None
        for place in self.places():
            try:
                fd, st = place.open_read(relpath)
            except FileNotFound:
                continue
            except InvalidPath:
                if place is self:
                    raise
                continue  # the reserved directory's own path is no concern of the caller's
            if best is not None:
                older, best = (
                    (best, (place, fd, st))
                    if st.st_mtime_ns >= best[2].st_mtime_ns
                    else ((place, fd, st), best)
                )
                os.close(older[1])
            else:
                best = (place, fd, st)
        return best

    def relocate_containers(self, relpaths: Callable[[], Iterable[str]]) -> list[str]:
        """An earlier tierd kept containers at their plain paths (and told them by their first
        bytes). A tier without its ``.tierd-compressed`` directory yet may hold such: each of
        ``relpaths()`` (the catalog's containers on this tier) still there is moved to it. A
        tier that has the directory is done (it is made with the first container this layout
        writes), so a start after the first costs one ``stat``."""
        places = self.places()
        if len(places) == 1 or places[1].root.exists():
            return []
        return [rel for rel in relpaths() if self._relocate(places[1], rel)]

    def _relocate(self, packed: DirectoryTier, relpath: str) -> bool:
        """Move one container to ``packed``; False where there is nothing to move (gone, or
        not a container: the record is stale, and the scan decides)."""
        if packed._lstat_here(relpath) is not None:
            return False
        try:
            fd, _ = self.open_read(relpath)
        except (FileNotFound, InvalidPath):
            return False
        try:
            if os.pread(fd, len(MAGIC), 0) != MAGIC:
                return False
        finally:
            os.close(fd)
        dirs, name = split_relpath(relpath)
        src = self.open_dir(dirs)
        try:
            dst = packed.open_dir(dirs, create=True)
            try:
                os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)
                os.fsync(dst)
            finally:
                os.close(dst)
            os.fsync(src)
        finally:
            os.close(src)
        log.info("tier %s: %r moved to %s (a container)", self.name, relpath, COMPRESSED_DIR)
        return True

    def open(
        self, relpath: str, *, etag: str | None = None, known: Stat | None = None
    ) -> DirectorySource:
        found = self._found(relpath)
        if found is None:
            raise FileNotFound(f"no file at path {relpath!r} on disk", path=relpath)
        place, fd, st = found
        if place is self:
            return DirectorySource(self, relpath, fd, st)
        try:
            c = Container.open(relpath, lambda n, off: pread_exact(fd, n, off), st.st_size)
        except BaseException:
            os.close(fd)
            raise
        return CompressedSource(self, relpath, fd, st, c, place)

    def stat(self, relpath: str) -> Stat | None:
        """The regular file beneath the root (opened, never followed), or None; a compressed
        one's logical size. Raises :class:`~tiering.codec.CorruptContainer` for a container
        whose footer or index is damaged."""
        try:
            with self.open(relpath) as src:
                return src.stat
        except (FileNotFound, InvalidPath):
            return None

    def lstat(self, relpath: str) -> Stat | None:
        """``lstat`` of the name ``relpath`` (the newer, where both places hold it): None if
        absent or not a regular file."""
        found = [st for place in self.places() if (st := place._lstat_here(relpath)) is not None]
        return max(found, key=lambda st: st.mtime_ns, default=None)

    def _lstat_here(self, relpath: str) -> Stat | None:
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
        """A :class:`DirectoryWriter` at the place the file's form names: on a compressing
        tier, opened when the encoder has decided (a container goes under
        ``.tierd-compressed``). Either way the other place is checked too: without
        ``overwrite`` a file there is :class:`AlreadyExists`; with it, the other form is
        removed once the new one is published."""
        places = self.places()

        def at(packed: bool) -> DirectoryWriter:
            place = places[-1] if packed else places[0]
            beside = places[0] if packed else places[-1]
            return DirectoryWriter(
                place,
                relpath,
                overwrite=overwrite,
                limit=limit,
                temp_stem=temp_stem,
                checksum=None if self.compresses else checksum,
                beside=None if beside is place else beside,
            )

        if not self.compresses or len(places) == 1:
            return at(False)
        if not overwrite:
            for place in places:
                if place._lstat_here(relpath) is not None:
                    raise AlreadyExists(
                        f"{relpath!r} already exists in tier {self.name}; pass overwrite=true",
                        path=relpath,
                    )
        return CompressingWriter(
            self, relpath, checksum, at, room=partial(check_room, self.name, limit), read_back=True
        )

    def remove(
        self,
        relpath: str,
        *,
        version: str | None = None,
        between: Callable[[], None] | None = None,
    ) -> bool:
        """Unlink and fsync the directory; with ``version``, only if it is still that inode.
        Without one, the file in either form."""
        removed = other = False
        for place in self.places():
            done = place._remove_here(relpath, version, between)
            removed = removed or done is True
            other = other or done is None
        if other and not removed:
            log.warning(
                "not removing %r on tier %s: it is not the file that was moved",
                relpath,
                self.name,
            )
        return removed

    def _remove_here(
        self, relpath: str, version: str | None, between: Callable[[], None] | None
    ) -> bool | None:
        """Unlink ``relpath`` at this place: True; False where it is absent; None where it is
        another file than ``version``."""
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
                    return None
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
        """Unlink the temp file ``.<temp_stem>.tierd-tmp`` in ``relpath``'s directory (at
        either place: a container's temp is in its own)."""
        return any([place._remove_temp_here(relpath, temp_stem) for place in self.places()])

    def _remove_temp_here(self, relpath: str, temp_stem: str) -> bool:
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
        files and its reserved directories; the containers of ``.tierd-compressed`` merged in
        by their relpaths (their entries' ``size`` is the stored size, ``codec`` says so, as
        an object tier's listing does: the walk opens no file).

        One directory's entries are listed and sorted at a time (a directory sorts by its name
        and ``/``, so its files come where their relpaths do); the walk holds only those of
        the directories it is inside.
        """
        places = self.places()
        plain = walk_dir(places[0].root, self.name, "", None)
        if len(places) == 1:
            return plain
        return merged_walk(plain, walk_dir(places[1].root, self.name, "", CODEC))

    def temps(self) -> Iterator[tuple[str, str]]:
        """``(relpath, stem)`` of tierd's temp files under the root (a container's temp under
        ``.tierd-compressed`` as the relpath of its directory there).

        ``relpath`` names a file in the temp's directory (the final name is not recorded in a
        temp's name), which is all :meth:`remove_temp` needs.
        """
        for place in self.places():
            yield from temps_under(place.root)
