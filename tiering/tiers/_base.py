"""The tier interface: the few primitives every kind of storage gives, and what tierd builds on
them.

Like fsspec's ``AbstractFileSystem``, a backend implements a handful of operations (open for
ranged reads, stat, walk, write-then-publish, remove, space) and everything else (moves,
recovery, scan, uploads, loads) is written once on top of them. Two backends exist:
:class:`~tiering.tiers.DirectoryTier` (a local directory) and
:class:`~tiering.tiers.ObjectTier` (an S3-protocol bucket prefix).

Every backend keeps the same promises, which the shared test suite (``tests/tiers``) checks:

- a :class:`Writer` is invisible until :meth:`Writer.publish`, and publishing never clobbers a
  file it was not told to replace;
- a removal with ``version`` removes nothing unless the name still holds that version, so a
  move or its recovery only deletes what it can prove is the copy it made or moved;
- a :class:`Stat`'s ``version`` tells two files at one name apart.

Callers ask a tier what it can do (:class:`Capabilities`, :meth:`Source.local_file`), never
which backend it is: outside this package no code compares a tier's ``kind`` (a test of the
layout checks it).

Kept whole past 450 lines: the tier interface (Source, Writer, Tier) and the values its
primitives return, which every backend reads together.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

from tiering.closing import Closing
from tiering.config import TierConfig
from tiering.errors import FileNotFound, IntegrityError, InvalidPath, TierdError
from tiering.integrity import version_of
from tiering.ranges import RangeReader

__all__ = [
    "UNBOUNDED",
    "Capabilities",
    "LocalFile",
    "Published",
    "Source",
    "Space",
    "Stat",
    "Tier",
    "WalkEntry",
    "Writer",
]

#: ``Space.free`` of a backend that sets no limit of its own (an object store): a quota, when
#: configured, is then the only bound.
UNBOUNDED = 1 << 62


@dataclass(frozen=True)
class Capabilities:
    """What a tier can do. Callers ask these, never which backend a tier is."""

    #: One origin for every host of a fleet (a bucket): its files are no host's own, and on a
    #: shared catalog they stay on it (hosts keep copies instead of moving them).
    shared: bool = False
    #: Can keep this host's copies of shared files beneath it (:meth:`Tier.copies`).
    holds_copies: bool = False
    #: Its sources are local files (:meth:`Source.local_file`): cheap to hash, a page cache to
    #: warm, changes the watcher sees (:meth:`Tier.watch_root`).
    local_files: bool = False
    #: GPUDirect Storage can read its files straight into GPU memory (where the host has it).
    direct_gpu: bool = False
    #: Every read is conditional on the version (ETag) the catalog recorded, so that version
    #: vouches for the bytes without a request to the store.
    pinned_reads: bool = False


@dataclass(frozen=True)
class LocalFile:
    """A source's bytes as a local file: ``fd`` is the source's own descriptor (valid while the
    source is open; a caller that keeps the file duplicates it), ``path`` names the file (its
    tier, messages) and is never reopened by a caller that has ``fd``."""

    fd: int
    path: Path


@dataclass(frozen=True)
class Space:
    """Capacity of a tier's storage. ``total`` and ``used`` are None when the backend cannot
    say (an object store has no capacity); ``free`` is then :data:`UNBOUNDED`."""

    total: int | None
    used: int | None
    free: int


@dataclass(frozen=True)
class Stat:
    """A file as its tier sees it now.

    ``version`` tells two files at one name apart: ``"<dev>:<ino>"`` in a directory, the ETag
    in an object store. ``etag`` is the ETag where the backend has one (what the catalog
    records to notice a change behind tierd's back), else None. ``checksum`` is tierd's
    content checksum when the backend stores it with the file (object metadata), else None.
    ``mode`` and ``atime_ns`` are what a directory copy restores; other backends give
    defaults. ``size`` is always the logical file's (what readers get); ``codec`` names how
    the tier stores it where not as it is (``tiering.codec``'s ``CODEC``), and
    ``stored_size`` the bytes it takes there (both None for a file stored as it is).
    """

    size: int
    mtime_ns: int
    version: str
    checksum: str | None = None
    etag: str | None = None
    mode: int = 0o644
    atime_ns: int = 0
    codec: str | None = None
    stored_size: int | None = None

    def same_file(self, other: Stat) -> bool:
        """The same file (inode or object version), unchanged in size and time."""
        return (self.version, self.size, self.mtime_ns) == (
            other.version,
            other.size,
            other.mtime_ns,
        )


@dataclass(frozen=True)
class WalkEntry:
    """One file found by :meth:`Tier.walk`. ``dev``/``ino`` are 0 where there are no inodes;
    ``etag`` is set by backends that have one.

    ``size`` is the logical file's, unless ``codec`` is set: then the listing showed only the
    bytes the file takes stored with that codec (an object tier's listing of a compressed
    object: its logical size is in the object's footer, one request away), and ``size`` is
    those, to compare with a record's ``stored_size``.
    """

    relpath: str
    size: int
    mtime_ns: int
    dev: int = 0
    ino: int = 0
    etag: str | None = None
    codec: str | None = None
    #: Set where the walk found a name it lists but no file tierd takes (a symbolic link in a
    #: directory tier): why, for the scan's report. Such an entry is never adopted.
    skipped: str | None = None


@dataclass(frozen=True)
class Published:
    """A file a :class:`Writer` made visible, with the checksum of the bytes it wrote.

    ``size``, ``checksum`` and ``stat.size`` are the logical file's (see :class:`Stat` for
    how the tier stores it).
    """

    relpath: str
    size: int
    mtime_ns: int
    checksum: str
    stat: Stat

    @property
    def etag(self) -> str | None:
        return self.stat.etag


class Source(Closing, abc.ABC):
    """A file opened for ranged reads; it keeps reading the bytes it opened.

    A directory source reads through its fd, so a rename or unlink of the path does not
    change what it serves. An object source reads with ``If-Match`` on the ETag it opened, so
    it never mixes two versions.
    """

    relpath: str
    stat: Stat

    @property
    def size(self) -> int:
        return self.stat.size

    def version_on_disk(self) -> str:
        """Which version of the stored file this is, as a walk would list it (see
        :func:`tiering.integrity.version_of`): the ETag, or the stored size and mtime."""
        st = self.stat
        return version_of(st.stored_size or st.size, st.mtime_ns, st.etag)

    # A source gives its own fast path: a local file, or a range reader of remote bytes.
    def local_file(self) -> LocalFile | None:
        """The bytes as a local file (the fast path: a file the I/O engines open by its fd),
        or None when they are not in one; reads then go through :meth:`readinto`."""
        return None

    def stored_file(self) -> LocalFile | None:
        """The local file holding the stored bytes: the file itself, or a compressed file's
        container (what warming the page cache reads), or None when they are not local."""
        return self.local_file()

    @property
    def ranges(self) -> RangeReader | None:
        """The bytes as a :class:`~tiering.ranges.RangeReader` (what ``tiering.io`` reads a
        file with no local descriptor through), or None for a local file."""
        return None

    @abc.abstractmethod
    def readinto(self, buf: memoryview, offset: int) -> int:
        """Read up to ``len(buf)`` bytes at ``offset``; fewer only at the end of the file."""

    def chunks(self, chunk_size: int) -> Iterator[memoryview]:
        """The file's bytes from the start, in order. A view is valid until the next one.

        Backends override it to read ahead (an object source keeps several ranged GETs in
        flight); the default reads one chunk at a time.
        """
        buf = bytearray(chunk_size)
        view = memoryview(buf)
        off = 0
        while True:
            n = self.readinto(view, off)
            if n == 0:
                return
            yield view[:n]
            off += n

    @abc.abstractmethod
    def unchanged(self) -> bool:
        """The name still holds the file that was opened, unchanged (checked before a switch)."""

    def close(self) -> None:  # noqa: B027 - a source with nothing to release keeps the default
        pass


class Aborting:
    """Mixin: a context manager whose exit is ``self.abort()``; subclasses define ``abort``.

    A write's with-shape: leaving the block without publishing discards what was written, and
    after a publish ``abort`` is a no-op. (Not :class:`~tiering.closing.Closing`: what its exit
    calls is a discard, not a close.) Writers and the moves' uploads share it.
    """

    def abort(self) -> None:  # pragma: no cover - every subclass says what discarding means
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()


class Writer(Aborting, abc.ABC):
    """Writes one new file into a tier, invisible to readers until :meth:`publish`.

    Use as a context manager: leaving the block without publishing discards what was written.
    ``limit`` (bytes) is enforced on every write with :class:`~tiering.errors.InsufficientSpace`.
    """

    tier: Tier
    relpath: str
    size: int = 0
    #: The checksum the caller said the bytes must have (``writer(checksum=...)``), if any.
    expected: str | None = None

    @property
    @abc.abstractmethod
    def checksum(self) -> str:
        """Checksum of the bytes written so far."""

    def refuse_unexpected(self) -> str:
        """Before a publish: the checksum of the bytes written (hashed once: a positional
        writer hashes its whole file for it); unless it is :attr:`expected`, abort and raise
        :class:`~tiering.errors.IntegrityError` (nothing is published)."""
        value = self.checksum
        if self.expected is not None and value != self.expected:
            self.abort()
            raise IntegrityError(
                f"{self.relpath!r}: the bytes written hash to {value}, "
                f"not {self.expected}; nothing was published",
                path=self.relpath,
            )
        return value

    @property
    @abc.abstractmethod
    def synced(self) -> Stat | None:
        """What :meth:`sync` made durable, once it succeeded.

        After a failed :meth:`publish` the caller uses it to tell whether the name now at the
        final path is this writer's file.
        """

    @abc.abstractmethod
    def write(self, data: bytes | memoryview) -> None: ...

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        """Write ``data`` at ``offset`` of the unpublished file (pieces landing out of order,
        from several threads); the checksum is then of the whole file as it is at
        :meth:`publish`. A writer takes either :meth:`write` or this, not both. Backends that
        cannot (an object store's upload is in order) raise
        :class:`~tiering.errors.TierdError`."""
        raise TierdError(f"tier {self.tier.name} takes no positional writes")

    def local_fd(self) -> int | None:
        """The unpublished file's descriptor, for a copy made outside this object (another
        process writing it with ``pwrite``, then :meth:`written_outside`); None where the writer
        has no local file (an upload, a compressing writer) or something was written already."""
        return None

    def written_outside(self, size: int, checksum: str) -> None:
        """Bytes ``[0, size)`` of :meth:`local_fd` were written outside this object and hash to
        ``checksum``: the writer syncs and publishes them as if :meth:`write` had."""
        raise TierdError(f"tier {self.tier.name} takes no bytes written outside its writer")

    def read_at(self, offset: int, length: int) -> bytes:
        """Bytes already written at ``offset`` of the unpublished file (a fill relays the
        pieces it verified before it publishes); see :meth:`write_at`."""
        raise TierdError(f"tier {self.tier.name} cannot read an unpublished file")

    @abc.abstractmethod
    def sync(self, *, mode: int | None = None, times_ns: tuple[int, int] | None = None) -> Stat:
        """Make the written bytes durable (still unpublished); idempotent.

        A failed sync discards the temp (it is never retried). ``mode`` and ``times_ns`` are
        restored by backends that keep them.
        """

    @abc.abstractmethod
    def publish(self) -> Published:
        """Sync, then make the file visible under its final name, durably."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard everything written (idempotent; a no-op after publish)."""


class Tier(abc.ABC):
    """One tier. ``rank`` 0 is the fastest.

    Subclasses set :attr:`kind` (a name for people and reports: callers never branch on it)
    and :attr:`capabilities`, and implement the abstract primitives; :meth:`probe` is built on
    them.
    """

    kind: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def __init__(self, config: TierConfig, rank: int) -> None:
        self.name = config.name
        self.quota_bytes = config.quota_bytes
        self.rank = rank
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.location!r}, rank={self.rank})"

    @property
    @abc.abstractmethod
    def location(self) -> str:
        """Where the tier is, for people: a path or a URL, never a credential."""

    def watch_root(self) -> Path | None:
        """The local directory whose filesystem events show changes to the tier's files (the
        watcher watches it), or None: changes are then found by a paced reconcile."""
        return None

    def copies(self) -> Tier:
        """Where this host keeps copies of shared files beneath this tier, as a tier of its own
        (named like this one; its names are copy names, never relpaths of this tier, and its
        files are never this tier's). Only for tiers that can (``capabilities.holds_copies``).
        """
        raise TierdError(f"tier {self.name} cannot hold copies of shared files")

    def origin_bytes_read(self) -> int:
        """Bytes this process read from the tier's remote origin (a bucket's ranged reads,
        whatever read them); 0 for a tier of local files."""
        return 0

    # -- life --------------------------------------------------------------------------------
    @abc.abstractmethod
    def check(self) -> None:
        """Make sure the tier is usable (create a directory root; reach and write a bucket).

        Raises :class:`~tiering.errors.TierUnavailable` naming the tier and the reason.
        """

    def close(self) -> None:  # noqa: B027 - a tier with no connections keeps the default
        """Release connections and threads."""

    @abc.abstractmethod
    def reachable(self) -> bool:
        """A cheap readiness probe (no writes): can the tier be used right now?"""

    @abc.abstractmethod
    def space(self) -> Space: ...

    # -- files -------------------------------------------------------------------------------
    @abc.abstractmethod
    def open(self, relpath: str, *, etag: str | None = None, known: Stat | None = None) -> Source:
        """Open a file for ranged reads.

        ``etag``: the version the catalog recorded; a file whose version differs raises
        :class:`~tiering.errors.FileChanged` (backends without ETags ignore it).
        ``known``: the size and time the catalog recorded with that ``etag``. A backend whose
        every read is conditional on the ETag may trust it instead of asking the store (an
        object tier then sends no HEAD: a small load is one request, not two), and a changed
        file raises :class:`~tiering.errors.FileChanged` at the first read instead.
        Raises :class:`~tiering.errors.FileNotFound` or :class:`~tiering.errors.InvalidPath`.
        """

    @abc.abstractmethod
    def stat(self, relpath: str) -> Stat | None:
        """The file at ``relpath``, or None when there is none."""

    @abc.abstractmethod
    def walk(self) -> Iterator[WalkEntry]:
        """Every file of the tier, skipping tierd's temp names and names it cannot serve, in
        relpath order (of code points, which is UTF-8 byte order), lazily: scan merges the
        walks of every tier with the catalog in one pass of bounded memory."""

    @abc.abstractmethod
    def writer(
        self,
        relpath: str,
        *,
        overwrite: bool = False,
        limit: int | None = None,
        temp_stem: str | None = None,
        checksum: str | None = None,
    ) -> Writer:
        """A :class:`Writer` for ``relpath``.

        ``overwrite``: replace an existing file on publish (else publishing onto an existing
        name raises :class:`~tiering.errors.AlreadyExists`, as does opening the writer when
        the name exists already). ``temp_stem`` names the temp (a move's intent), so
        :meth:`remove_temp` can find it after a crash. ``checksum``: the content checksum the
        bytes must have: :meth:`Writer.publish` refuses other bytes with
        :class:`~tiering.errors.IntegrityError` (publishing nothing), and backends that keep
        metadata store it with the file (object metadata).
        """

    @abc.abstractmethod
    def remove(
        self,
        relpath: str,
        *,
        version: str | None = None,
        between: Callable[[], None] | None = None,
    ) -> bool:
        """Remove the file durably; False (removing nothing) when it is gone, or when
        ``version`` is given and the name now holds another version.

        ``between`` runs after the removal and before it is made durable (a test hook's step).
        """

    @abc.abstractmethod
    def remove_temp(self, relpath: str, temp_stem: str) -> bool:
        """Remove what a writer for ``relpath`` with ``temp_stem`` left unpublished."""

    @abc.abstractmethod
    def temps(self) -> Iterator[tuple[str, str]]:
        """``(relpath, temp_stem)`` of everything unpublished that tierd's writers left, such
        that ``remove_temp(relpath, temp_stem)`` removes it."""

    def relocate_containers(self, relpaths: Callable[[], Iterable[str]]) -> list[str]:
        """Bring containers an earlier tierd stored at the files' own paths to the place where
        this one reads them (``relpaths()``: the files the catalog says are containers, asked
        only where the tier may hold such); those moved. Only directory tiers ever did."""
        return []

    # -- built on the primitives ---------------------------------------------------------------
    def probe(self, relpath: str) -> tuple[str, Stat] | None:
        """Checksum of the file's bytes (read in full) and its stat, or None if absent."""
        try:
            src = self.open(relpath)
        except (FileNotFound, InvalidPath):
            return None
        from tiering.checksum import Hasher  # xxhash: the client imports tiers without it

        with src:
            h = Hasher()
            for chunk in src.chunks(4 << 20):
                h.update(chunk)
            return h.value(), src.stat

    def read_bytes(self, relpath: str) -> bytes:
        """The whole file (small files: tests, metadata)."""
        with self.open(relpath) as src:
            return b"".join(bytes(c) for c in src.chunks(4 << 20))
