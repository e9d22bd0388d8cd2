"""Compressed objects: what an object tier stores in tierd's container, read as the file.

An object tier whose ``compression`` is on (``auto``, its default: objects tierd itself
writes) stores a file that gains enough (:mod:`tiering.codec`) as a container under the
reserved ``.tierd-compressed/`` directory of its prefix, at ``<prefix>/.tierd-compressed/
<relpath>``; other files, and every object adopted from the bucket, stay at ``<prefix>/
<relpath>`` as they are. The place says which a key is, so:

- a listing tells them apart without a request per object (a compressed object's listed size
  is its stored size: :class:`~tiering.tiers.WalkEntry` says so with ``codec``);
- another tool reading the bucket never takes a container for the file it holds (the README
  says what the directory is);
- the two places merge into one walk in relpath order (two listings, each in key order).

**Reading.** :class:`CompressedObjectSource` opens the container's footer and index by ranged
GETs pinned to the ETag (``If-Match``), like every read of the object; its ``stat`` and
``ranges`` are the logical file's. The stored bytes of a chunk are read as parallel GETs of
:data:`STORED_PART` on the tier's connection pool (a chunk is about 5.5 MiB stored: several
connections per chunk, as a raw read of the same bytes would use), and decoded on the tier's
decode pool, a different pool, so a decode waiting on its GETs never holds a connection
thread. Into a GPU, the stored chunks cross PCIe and are decoded there (the reader's
``encoded`` container: :mod:`tiering.io._decode_gpu`).

**Writing** goes through :class:`~tiering.tiers._compressed.CompressingWriter`: the multipart
upload is started at the encoder's decision, at the key that decision names; each chunk is
decoded and checked as it is encoded (a multipart upload's parts cannot be read before they
are published), each part carries a CRC32 the store checks, and the HEAD after completion
checks the stored size and tierd's checksum (of the logical bytes) in the metadata.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor
from typing import ClassVar, Literal

from tiering.codec import Container
from tiering.ranges import KvikioRanges, RangeReader
from tiering.tiers._base import Stat, Tier
from tiering.tiers._compressed import CompressedRanges, logical_stat
from tiering.tiers._object_io import ObjectSource
from tiering.tiers._object_reads import ObjectRanges
from tiering.tiers._store import MiB, S3Store

__all__ = ["STORED_PART", "CompressedObjectSource"]

log = logging.getLogger(__name__)

#: Bytes per GET of a compressed object's stored chunks. Small: a decoder reads a batch of
#: chunks and waits for the last, so the time of one GET bounds a batch. Measured on an H100
#: host against an S3-like origin (nginx, 100 MB/s a connection), 32 chunks of a 2 GiB bf16
#: checkpoint at a time through KvikIO: one GET per chunk 4.2 GB/s of stored bytes, 1 MiB
#: GETs 13.8 (a plain object's whole read: 11.3).
STORED_PART = 1 * MiB


class CompressedObjectRanges(CompressedRanges):
    """A compressed object's logical bytes as ranges (a load says they came from the bucket)."""

    source: ClassVar[Literal["object_store", "peer", "storage"]] = "object_store"

    def __init__(self, container: Container, stored: ObjectRanges, pool: Executor) -> None:
        super().__init__(container, stored.version, pool)
        self.stored = stored

    def check_unchanged(self) -> None:
        """The object still holds the ETag opened (for a decoder that found a chunk damaged:
        a replaced object is a change, not damage)."""
        self.stored.check_unchanged()


class CompressedObjectSource(ObjectSource):
    """A container in an object tier opened at one ETag, read as its logical file."""

    def __init__(
        self, tier: Tier, store: S3Store, relpath: str, key: str, stored: Stat, pool: Executor
    ) -> None:
        super().__init__(tier, store, relpath, key, stored)
        self.stored = self._ranges  # the object's own bytes, every GET pinned to the ETag
        self.stored.part_size = STORED_PART
        name = store.url_of(key)
        c = Container.open(name, self._read_at, stored.size)
        # A decoder that reads whole stored chunks (the GPU's) reads them through KvikIO's
        # RemoteFile where it wins, as a plain object's load does: libcurl's threads, not
        # Python's, so the chunks of a batch keep every connection busy. Its reads cannot send
        # If-Match, but each chunk is checked against the digest in the index, which was read
        # pinned: bytes of another version fail that check, and the decoder then asks
        # check_unchanged whether the object was replaced.
        self._by_url: KvikioRanges | None = None
        if store.kvikio.wins(self.stored, stored.size):
            self._by_url = store.kvikio.open(self.stored)
        self.container = c.reading(self._read_at, self._stored_into)
        self.stat = logical_stat(stored, c.size)
        self._logical = CompressedObjectRanges(self.container, self.stored, pool)

    def _stored_into(self, view: memoryview, offset: int) -> int:
        n = max(0, min(len(view), self.stored.size - offset))
        if self._by_url is None:
            return self.stored.readinto(view[:n], offset)
        # A range KvikIO fails is read again by the tier's GETs; after an error the rest are
        # cancelled and waited for, so none is left writing into the caller's buffer.
        by_url = self._by_url
        parts = [
            by_url.start(view[s : min(n, s + STORED_PART)], offset + s)
            for s in range(0, n, STORED_PART)
        ]
        error: BaseException | None = None
        for part in parts:
            if error is not None:
                part.cancel()
            try:
                part.result()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error
        return n

    def close(self) -> None:
        if self._by_url is not None:
            self._by_url.close()
        super().close()

    def _read_at(self, n: int, offset: int) -> bytearray:
        buf = bytearray(max(0, min(n, self.stored.size - offset)))
        self.stored.readinto(memoryview(buf), offset)
        return buf  # bytes-like: a chunk's stored bytes are not copied again

    @property
    def ranges(self) -> RangeReader:  # type: ignore[override]
        return self._logical

    def readinto(self, buf: memoryview, offset: int) -> int:
        return self._logical.readinto(buf, offset)

    def _chunk_reader(self) -> RangeReader:
        # The stored bytes are not the file's: KvikIO's RemoteFile cannot read them.
        return self._logical

    def unchanged(self) -> bool:
        return self.stored.head_matches() is not None
