"""Compressed files on a directory tier: read as their logical bytes, written compressed.

A directory tier whose ``compression`` is on stores the files it writes in tierd's container
(:mod:`tiering.codec`) when that saves enough, under its ``.tierd-compressed`` directory at
their relpaths (:data:`~tiering.tiers.paths.COMPRESSED_DIR`, as an object tier does under its
prefix); any directory tier reads the containers it holds there. Where a file is says what
it is: a user's file that happens to begin with the container's magic is never decoded.

- **Reading.** :meth:`DirectoryTier.open <tiering.tiers.DirectoryTier.open>` finds the relpath
  at one of its two places and, for a container, returns a :class:`CompressedSource`: its
  ``stat`` and
  ``size`` are the logical file's, it has no ``local_file()`` (its disk bytes are not the
  file's), and its ``ranges`` is a :class:`~tiering.ranges.RangeReader` that decodes, so every
  read path that reads an object or a peer reads it unchanged. Each range decodes only the
  chunks it touches, on the tier's decode pool, each chunk checked against its digest.
- **Writing.** :class:`CompressingWriter` is the tier's own :class:`DirectoryWriter` (temp,
  fsync, no-clobber publish: one place for the durability rules) fed by a streaming
  :class:`~tiering.codec.Encoder`. Its ``checksum`` and ``size`` are of the logical bytes
  (what the catalog keeps); its ``limit`` bounds the bytes stored. :meth:`~Writer.sync` decodes
  the synced temp and refuses it unless it reads back as the bytes written, so a move or an
  upload never publishes a copy that does not decode.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from typing import ClassVar, Literal

from tiering.codec import CHUNK, CODEC, Container, Encoder
from tiering.errors import IntegrityError, TierdError
from tiering.ranges import RangeReader
from tiering.tiers._base import Published, Stat, Tier, WalkEntry, Writer
from tiering.tiers._dirwriter import DirectoryWriter

__all__ = [
    "CompressedRanges",
    "CompressingWriter",
    "logical_stat",
    "merged_walk",
    "one_per_relpath",
]

log = logging.getLogger(__name__)


class CompressedRanges(RangeReader):
    """A container's logical bytes as ranges: each decoded from the chunks it touches.

    A range of more than a chunk is decoded as chunk-sized parts on the tier's pool (zstd
    releases the GIL, so the parts run on several cores).
    """

    source: ClassVar[Literal["object_store", "peer", "storage"]] = "storage"

    def __init__(self, container: Container, version: str, pool: Executor) -> None:
        super().__init__(container.name, container.size, version, pool=pool, part_size=CHUNK)
        self.container = self.encoded = container

    def get(self, view: memoryview, offset: int) -> None:
        n = self.container.readinto(view, offset)
        if n != len(view):
            raise TierdError(f"{self.name}: range [{offset}, +{len(view)}) is past the end")


def logical_stat(st: Stat, size: int) -> Stat:
    """A container's stat as its logical file's: the same inode and times, the logical size,
    the codec and the stored size."""
    return dataclasses.replace(st, size=size, codec=CODEC, stored_size=st.size)


class CompressingWriter(Writer):
    """Compresses as it writes, into a writer of the tier (see the module).

    ``inner`` is the writer the stored bytes go to, or ``inner(compressed)`` gives it, called
    once, when the encoder has decided whether the file goes in a container (a tier that
    stores the two kinds under different names, as an object tier does, opens the right one
    then).
    ``room(n)`` raises while the decision is pending and ``n`` logical bytes would not fit.
    With ``read_back`` the synced bytes are read again and decoded before publish (a
    directory tier's temp file); otherwise each chunk is decoded and checked as soon as it is
    encoded, before it reaches the inner writer (parts of a multipart upload cannot be read
    before they are published). Either way no copy is published that does not decode.
    """

    def __init__(
        self,
        tier: Tier,
        relpath: str,
        expected: str | None,
        inner: Writer | Callable[[bool], Writer],
        *,
        room: Callable[[int], None],
        read_back: bool,
    ) -> None:
        from tiering.checksum import Hasher  # xxhash: the client imports tiers without it

        self.tier = tier
        self.relpath = relpath
        self.expected = expected
        self.size = 0
        self._inner: Writer | None = inner if isinstance(inner, Writer) else None
        self._open_inner = inner
        self._room = room
        self._read_back = read_back
        self._hasher = Hasher()
        self._encoder = Encoder(self._sink, verify=None if read_back else relpath)
        self._finished = False
        self._verified: Stat | None = None

    @property
    def checksum(self) -> str:
        return self._hasher.value()

    @property
    def inner(self) -> Writer:
        """The writer of the stored bytes (opened at the encoder's decision, or now)."""
        if self._inner is None:
            assert not isinstance(self._open_inner, Writer)
            self._inner = self._open_inner(bool(self._encoder.compressed))
        return self._inner

    def _sink(self, data: bytes | memoryview) -> None:
        self.inner.write(data)

    @property
    def stored_size(self) -> int:
        """Bytes stored so far (the container's, or the plain file's)."""
        return 0 if self._inner is None else self._inner.size

    @property
    def compressed(self) -> bool:
        return bool(self._encoder.compressed)

    @property
    def synced(self) -> Stat | None:
        st = None if self._inner is None else self._inner.synced
        return None if st is None else self._logical(st)

    def _logical(self, st: Stat) -> Stat:
        if self._encoder.compressed:
            return logical_stat(st, self.size)
        return st

    def write(self, data: bytes | memoryview) -> None:
        if self._finished:
            raise TierdError("write after sync, publish or abort")
        if self._encoder.compressed is None:
            # Still deciding (nothing stored yet): the logical bytes count against the limit,
            # as they do in the room a move checks before it starts.
            self._room(self.size + len(data))
        self._encoder.write(data)
        self._hasher.update(data)
        self.size += len(data)

    def sync(self, *, mode: int | None = None, times_ns: tuple[int, int] | None = None) -> Stat:
        """Finish the container and sync it; with ``read_back``, decode it again: a copy that
        does not read as the bytes written is discarded and
        :class:`~tiering.errors.IntegrityError` raised."""
        if self._verified is not None:
            return self._verified
        if not self._finished:
            self._finished = True
            try:
                self._encoder.finish()
            except BaseException:
                self.abort()
                raise
        st = self.inner.sync(mode=mode, times_ns=times_ns)
        if self._encoder.compressed and self._read_back:
            self._verify()
        self._verified = self._logical(st)
        return self._verified

    def _verify(self) -> None:
        from tiering.checksum import Hasher

        inner = self.inner
        assert isinstance(inner, DirectoryWriter)  # read_back is a directory writer's
        try:
            c = Container.open(self.relpath, lambda n, off: inner.read_at(off, n), self.stored_size)
            h = Hasher()
            for i in range(len(c.index)):
                h.update(c.chunk(i).data)
            ok = c.size == self.size and h.value() == self.checksum
        except IntegrityError:
            ok = False
        if not ok:
            inner.abort()
            raise IntegrityError(
                f"{self.relpath!r}: the compressed copy on tier {self.tier.name} does not decode "
                "to the bytes written; nothing was published",
                path=self.relpath,
            )

    def publish(self) -> Published:
        self.refuse_unexpected()
        self.sync()
        done = self.inner.publish()
        stat = self._logical(done.stat)  # the published object's time (a bucket sets its own)
        return Published(self.relpath, self.size, stat.mtime_ns, self.checksum, stat)

    def abort(self) -> None:
        self._finished = True
        if self._inner is not None:
            self._inner.abort()


def merged_walk(plain: Iterable[WalkEntry], packed: Iterable[WalkEntry]) -> Iterator[WalkEntry]:
    """The walks of a tier's plain and compressed places (each in relpath order) as one."""
    return one_per_relpath(heapq.merge(plain, packed, key=lambda e: e.relpath))


def one_per_relpath(entries: Iterable[WalkEntry]) -> Iterator[WalkEntry]:
    """One entry per relpath: where a relpath is at both places (an overwrite that changed
    the file's form and stopped before it removed the old copy), the newer one, which is the
    one that overwrite published (a tie: the compressed one, listed second)."""
    held: WalkEntry | None = None
    for e in entries:
        if held is not None and held.relpath == e.relpath:
            log.warning(
                "%r is stored both plain and compressed; the newer one is the file",
                e.relpath,
            )
            held = e if e.mtime_ns >= held.mtime_ns else held
            continue
        if held is not None:
            yield held
        held = e
    if held is not None:
        yield held
