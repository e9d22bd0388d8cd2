"""Reading and writing one object: parallel ranged GETs pinned to an ETag, and multipart uploads
that stay invisible until they are completed and verified.

A multipart upload is an object store's temp file: nothing at the key changes until
CompleteMultipartUpload, and AbortMultipartUpload discards every part. So a writer uploads
straight to the final key, and the "publish" of RELIABILITY.md is the completion (conditional
on the key being absent unless asked to overwrite), followed by a HEAD that must show the size
written and tierd's checksum in the metadata.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from tiering.checksum import Hasher
from tiering.errors import (
    AlreadyExists,
    InsufficientSpace,
    IntegrityError,
    TierdError,
)
from tiering.ranges import KvikioFailed, RangeReader, flat, read_ahead
from tiering.tiers._base import Published, Source, Stat, Tier, Writer
from tiering.tiers._object_reads import ObjectRanges
from tiering.tiers._s3 import error_code, error_status, translate
from tiering.tiers._store import META_CHECKSUM, S3Store

__all__ = ["ObjectSource", "ObjectWriter", "refuse_over_limit"]

log = logging.getLogger(__name__)

#: Metadata a writer stores with the object besides :data:`META_CHECKSUM` (what the HEAD after
#: publish must show): the temp stem (the move that wrote it) and a token unique to the writer
#: (so a writer can tell its own completed upload from anyone else's after an ambiguous
#: failure).
META_TEMP = "tierd-temp"
META_WRITER = "tierd-writer"
#: S3 allows 10,000 parts; the part size doubles every 1,000 parts so any size fits.
_PARTS_PER_SIZE = 1000
_MAX_PART = 5 << 30


def refuse_over_limit(tier: Tier, limit: int | None, n: int) -> None:
    """Raise :class:`~tiering.errors.InsufficientSpace` when ``n`` bytes exceed ``limit``."""
    if limit is not None and n > limit:
        raise InsufficientSpace(
            f"tier {tier.name} has room for {limit} more bytes only", tier=tier.name, limit=limit
        )


class ObjectSource(Source):
    """An object opened at one ETag. Every read sends ``If-Match`` with it, so a replaced
    object raises :class:`~tiering.errors.FileChanged` instead of mixing two versions; its
    reads are those of its :class:`~tiering.tiers._object_reads.ObjectRanges`."""

    def __init__(self, tier: Tier, store: S3Store, relpath: str, key: str, stat: Stat) -> None:
        self.tier = tier
        self.store = store
        self.relpath = relpath
        self.key = key
        self.stat = stat
        self._ranges = ObjectRanges(store, key, stat)

    @property
    def ranges(self) -> ObjectRanges:
        return self._ranges

    def readinto(self, buf: memoryview, offset: int) -> int:
        """Read into ``buf`` from ``offset``; ranges longer than a read part go out as parallel
        ranged GETs, each streaming into its own slice of ``buf``."""
        return self._ranges.readinto(buf, offset)

    def chunks(self, chunk_size: int) -> Iterator[memoryview]:
        """The object in order, with a window of ranged reads in flight ahead of the reader
        (:func:`~tiering.ranges.read_ahead`, ``readahead_bytes`` of the tier).

        The reads go through KvikIO's ``RemoteFile`` where the tier's ``read_engine`` allows
        it (libcurl's threads leave the GIL to the consumer, which hashes and writes), else
        through the tier's GETs with ``If-Match``. KvikIO's reads cannot send ``If-Match``:
        the caller checks :meth:`unchanged` after the last chunk, as the mover does.
        """
        if self.stat.size == 0:
            return
        reader = self._chunk_reader()
        try:
            yield from read_ahead(
                reader,
                chunk_size,
                readahead_bytes=self.store.readahead_bytes,
                rings=self.store.rings,
            )
        finally:
            if reader is not self._ranges:
                reader.close()

    def _chunk_reader(self) -> RangeReader:
        """KvikIO over a presigned URL where it wins, opened now, else the tier's GETs."""
        kvikio = self.store.kvikio
        if not kvikio.wins(self._ranges, self.stat.size):
            return self._ranges
        reader = kvikio.open(self._ranges)
        try:
            reader.handle()
        except KvikioFailed as exc:
            reader.close()
            if kvikio.strict:
                raise OSError(f"KvikIO could not open {self.relpath!r}: {exc}") from exc
            log.warning(
                "reading %r with the tier's GETs: KvikIO failed to open it: %s", self.relpath, exc
            )
            return self._ranges
        except BaseException:  # FileChanged: the object was replaced since it was opened
            reader.close()
            raise
        return reader

    def unchanged(self) -> bool:
        """The key still holds the ETag and size that were opened."""
        return self._ranges.head_matches() is not None


class ObjectWriter(Writer):
    """A multipart upload to the final key, invisible until :meth:`publish`.

    Parts are uploaded from the tier's pool while the caller keeps writing; at most
    ``store.parts_in_flight`` parts (plus the one being filled) are held in memory, and
    :meth:`write` waits for the oldest part when that many are out. Each part carries a CRC32
    that the store checks on receipt. ``upload_id`` is known from construction on, so a move
    can journal it and recovery can abort it.

    ``key`` is where the object goes (the relpath's plain key unless given); ``other`` is the
    relpath's other place (a compressed object's key for a plain one, and the reverse): it
    must be absent too unless ``overwrite``, and an overwrite removes it once the new object
    is verified, so one relpath is one object. ``checksum`` is what the bytes written must
    hash to; ``label`` (default: ``checksum``) the checksum kept in the metadata, tierd's
    checksum of the file (for a compressed object, of its logical bytes).
    """

    def __init__(
        self,
        tier: Tier,
        store: S3Store,
        relpath: str,
        *,
        overwrite: bool = False,
        limit: int | None = None,
        temp_stem: str | None = None,
        checksum: str | None = None,
        key: str | None = None,
        other: str | None = None,
        label: str | None = None,
    ) -> None:
        self.tier = tier
        self.store = store
        self.relpath = relpath
        self.key = key or store.key(relpath)
        self.other = other
        self.label = checksum if label is None else label
        self.where = store.url_of(self.key)
        self.overwrite = overwrite
        self.limit = limit
        self.expected = checksum
        self.temp_stem = temp_stem or f"w-{secrets.token_hex(8)}"
        self.size = 0
        self._token = secrets.token_hex(12)
        self._hasher = Hasher()
        self._state = "open"  # -> "published" | "aborted"
        self._synced: Stat | None = None
        self._buf = bytearray(store.part_size)
        self._fill = 0
        self._next_part = 1
        self._inflight: deque[Future[dict[str, Any]]] = deque()
        self._parts: list[dict[str, Any]] = []
        if not overwrite:
            self.refuse_existing(tier, store, relpath, (self.key, *([other] if other else [])))
        meta = {META_TEMP: self.temp_stem, META_WRITER: self._token}
        if self.label:
            meta[META_CHECKSUM] = self.label
        resp = store.call(
            "start an upload to",
            self.where,
            store.client.create_multipart_upload,
            Bucket=store.bucket,
            Key=self.key,
            Metadata=meta,
            ChecksumAlgorithm="CRC32",
        )
        self.upload_id: str = resp["UploadId"]

    @staticmethod
    def refuse_existing(tier: Tier, store: S3Store, relpath: str, keys: tuple[str, ...]) -> None:
        """Raise :class:`~tiering.errors.AlreadyExists` if any of ``keys`` (the relpath's
        places) holds an object."""
        if any(store.head(k) is not None for k in keys):
            raise AlreadyExists(
                f"{relpath!r} already exists in tier {tier.name}; pass overwrite=true",
                path=relpath,
            )

    # -- the Writer interface --------------------------------------------------------------
    @property
    def checksum(self) -> str:
        return self._hasher.value()

    @property
    def synced(self) -> Stat | None:
        """After :meth:`sync`: the size, with version ``upload:<id>`` (no ETag exists yet)."""
        return self._synced

    def write(self, data: bytes | memoryview) -> None:
        self._require_open("write")
        view = flat(memoryview(data))
        refuse_over_limit(self.tier, self.limit, self.size + len(view))
        self._hasher.update(view)
        self.size += len(view)
        while view:
            take = min(len(view), len(self._buf) - self._fill)
            self._buf[self._fill : self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == len(self._buf):
                self._send_part()

    def sync(self, *, mode: int | None = None, times_ns: tuple[int, int] | None = None) -> Stat:
        """Upload the last part and wait for every part: durable in the store, still invisible.

        A failed part discards the whole upload (as a failed fsync discards a temp file).
        ``mode`` and ``times_ns`` are ignored: objects keep neither.
        """
        if self._synced is not None:
            return self._synced
        self._require_open("sync")
        try:
            if self._fill or self._next_part == 1:
                self._send_part()  # the last part (an empty object is one empty part)
            while self._inflight:
                self._parts.append(self._inflight.popleft().result())
        except BaseException:
            self.abort()
            raise
        self._synced = Stat(
            self.size, time.time_ns(), f"upload:{self.upload_id}", checksum=self.expected
        )
        return self._synced

    def publish(self) -> Published:
        """Complete the upload (no clobber unless ``overwrite``), then HEAD to verify it."""
        self._require_open("publish")
        self.refuse_unexpected()
        self.sync()
        self._complete()
        self._state = "published"
        head = self.store.head(self.key)
        if head is None or head.get("Metadata", {}).get(META_WRITER) != self._token:
            raise IntegrityError(
                f"{self.relpath!r} in tier {self.tier.name} was replaced by another writer "
                "before it could be verified",
                path=self.relpath,
            )
        st = self.store.stat_of(head)
        problems = []
        if st.size != self.size:
            problems.append(f"size {st.size} != {self.size} written")
        if self.label and st.checksum != self.label:
            problems.append(f"metadata checksum {st.checksum} != {self.label}")
        if problems:
            # It is this writer's object (the token says so), and it is wrong: take it back.
            try:
                self.store.delete_exact(self.key, st.version)
            except TierdError as exc:
                log.error("could not remove the unverified %s: %s", self.where, exc)
            raise IntegrityError(
                f"{self.relpath!r} in tier {self.tier.name} failed verification after upload "
                f"({'; '.join(problems)}); it was removed",
                path=self.relpath,
            )
        if self.overwrite and self.other is not None:
            self._remove_other()
        return Published(self.relpath, self.size, st.mtime_ns, self.checksum, st)

    def _remove_other(self) -> None:
        """After an overwrite that changed the file's form: remove the old form. A crash
        before this leaves both; the walk takes the newer one (the file), and the next
        overwrite or removal of the relpath takes the older one."""
        assert self.other is not None
        try:
            if self.store.head(self.other) is not None:
                self.store.delete(self.other)
        except TierdError as exc:
            log.warning(
                "could not remove the old form of %r at %s: %s",
                self.relpath,
                self.store.url_of(self.other),
                exc,
            )

    def abort(self) -> None:
        """Discard the upload and its parts (idempotent; a no-op after publish).

        A failed AbortMultipartUpload is logged, not raised (it would hide the error that
        led here): the upload stays listed by the tier's ``temps`` for the orphan sweep.
        """
        if self._state != "open":
            return
        self._state = "aborted"
        for fut in self._inflight:
            fut.cancel()
        # A part still being sent could land after the abort and be kept: wait for them first.
        wait(self._inflight)
        self._inflight.clear()
        self._buf = bytearray()
        try:
            self.store.abort_upload(self.key, self.upload_id)
        except TierdError as exc:
            log.warning("could not abort the upload of %s: %s", self.where, exc)

    # -- parts -------------------------------------------------------------------------------
    def _require_open(self, what: str) -> None:
        if self._state != "open":
            raise TierdError(f"{what} after publish or abort")

    def _send_part(self) -> None:
        """Hand the filled buffer to the pool as the next part, waiting while too many parts
        are out; a part that failed is raised here."""
        while len(self._inflight) >= self.store.parts_in_flight:
            done, _ = wait(self._inflight, return_when=FIRST_COMPLETED)
            for fut in list(self._inflight):
                if fut in done:
                    self._parts.append(fut.result())
                    self._inflight.remove(fut)
        body, number = self._buf, self._next_part
        del body[self._fill :]  # the last part is short: shrink in place, no copy
        self._next_part += 1
        self._inflight.append(self.store.pool.submit(self._upload_part, number, body))
        grow = 1 << ((self._next_part - 1) // _PARTS_PER_SIZE)
        self._buf = bytearray(min(_MAX_PART, self.store.part_size * grow))
        self._fill = 0

    def _upload_part(self, number: int, body: bytearray) -> dict[str, Any]:
        resp = self.store.call(
            f"upload part {number} of",
            self.where,
            self.store.client.upload_part,
            Bucket=self.store.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=body,
            ChecksumAlgorithm="CRC32",
        )
        part = {"PartNumber": number, "ETag": resp["ETag"]}
        if resp.get("ChecksumCRC32"):
            part["ChecksumCRC32"] = resp["ChecksumCRC32"]
        return part

    def _complete(self) -> None:
        """CompleteMultipartUpload; when its outcome is unclear (a 412 or NoSuchUpload after a
        retried request, a connection lost after retries), the HEAD decides: the key holds
        this writer's object (its token) or the upload is aborted and the error raised."""
        parts = sorted(self._parts, key=lambda p: int(p["PartNumber"]))
        cond = {} if self.overwrite else {"IfNoneMatch": "*"}
        try:
            self.store.client.complete_multipart_upload(
                Bucket=self.store.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
                **cond,
            )
            return
        except (ClientError, BotoCoreError) as exc:
            failure: BaseException = exc
        with contextlib.suppress(TierdError):
            head = self.store.head(self.key)
            if head is not None and head.get("Metadata", {}).get(META_WRITER) == self._token:
                return
        self.abort()
        if error_status(failure) == 412 or error_code(failure) == "PreconditionFailed":
            raise AlreadyExists(
                f"{self.relpath!r} appeared in tier {self.tier.name} during the write",
                path=self.relpath,
            ) from None
        raise translate(self.tier.name, "complete the upload of", self.where, failure) from failure
