"""Object-store tiers: a prefix of an S3-protocol bucket (AWS S3, MinIO, Ceph RGW, GCS's S3 API).

The file ``relpath`` is the object ``<prefix>/<relpath>``. Its version is the ETag: every read
is pinned to the ETag it opened (``If-Match``), a removal with a version is conditional on it,
and a change of ETag or size is how scan notices a file changed behind tierd's back.

**Ownership.** A tier's prefix belongs to tierd. The key of a file being moved or uploaded is
written only by that move or upload (the catalog's claim serialises them), so an unfinished
multipart upload under the prefix is always tierd's own, and aborting every unfinished upload
of a key (:meth:`ObjectTier.remove_temp`) discards only that move's temp. The orphan sweep
(:meth:`ObjectTier.temps`) must therefore run only when no writer of this tier is active: at
start, before serving.

The requests themselves (clients, pool, retries, error mapping) live in
:mod:`tiering.tiers._store`; readers and writers in :mod:`tiering.tiers._object_io`. boto3 is
imported only by deployments that have an object-store tier.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from tiering.codec import CODEC
from tiering.config import TierConfig
from tiering.errors import FileChanged, FileNotFound, InvalidPath, TierdError
from tiering.tiers._base import UNBOUNDED, Capabilities, Space, Stat, Tier, WalkEntry, Writer
from tiering.tiers._compressed import CompressingWriter, merged_walk
from tiering.tiers._listing import in_relpath_order
from tiering.tiers._object_io import ObjectSource, ObjectWriter, refuse_over_limit
from tiering.tiers._object_z import CompressedObjectSource
from tiering.tiers._s3 import mtime_ns, strip_etag, translate, unavailable
from tiering.tiers._store import MiB, S3Store
from tiering.tiers.paths import COMPRESSED_DIR, TEMP_SUFFIX, validate_relpath

__all__ = ["ObjectTier"]

log = logging.getLogger(__name__)

_PROBE = ".tierd-probe-"


class ObjectTier(Tier):
    """A tier in an S3-protocol bucket under ``url = "s3://bucket/prefix"``.

    Keyword arguments beyond the config (the defaults suit S3 and large model files). S3
    serves about 90 MB/s a connection and scales with parallel ranged GETs of 8-16 MiB (AWS's
    performance guidelines), so the defaults keep 64 GETs of 8 MiB in flight:

    - ``part_size``: bytes per uploaded part (S3 wants at least 5 MiB for all but the last).
      It doubles every 1,000 parts, so any object fits in S3's 10,000 parts.
    - ``parts_in_flight``: parts one writer may have uploading at once; a writer holds at most
      ``(parts_in_flight + 1) * part_size`` bytes (136 MiB by default).
    - ``read_size``: bytes per ranged GET; a longer read is split into parallel GETs. Large
      GETs amortise the per-request cost (S3's first-byte latency; moto copies the whole
      object for every range).
    - ``readahead_bytes``: how far :meth:`ObjectSource.chunks` reads ahead of its consumer (a
      promotion): ``readahead_bytes // read_size`` GETs in flight, that many buffers plus one.
    - ``workers``: threads of the tier's one pool, shared by every reader and writer of the
      tier; the connection pool has room for them and for the callers' own requests.
    - ``read_engine``: what reads an object in order for a promotion: ``"auto"`` (KvikIO's
      ``RemoteFile`` where it is installed with remote I/O, else botocore), ``"kvikio"`` or
      ``"boto3"`` (see :mod:`tiering.ranges._kvikio`).
    - ``compression``: ``"auto"`` (the default) or ``"on"`` stores the files this tier writes
      compressed where that pays (:mod:`tiering.tiers._object_z`); ``"off"`` stores them as
      they are. Objects adopted from the bucket are never rewritten; every object tier reads
      the compressed objects it finds.
    - ``max_attempts``: tries per request (botocore's standard retry mode; ours for a GET body
      that breaks after its headers).
    - ``connect_timeout``, ``read_timeout``: seconds, per attempt; ``check_timeout``: both, for
      :meth:`check` and :meth:`reachable`, which try twice at most.
    """

    kind = "object"
    capabilities = Capabilities(shared=True, pinned_reads=True)

    def __init__(
        self,
        config: TierConfig,
        rank: int,
        *,
        part_size: int = 8 * MiB,
        parts_in_flight: int = 16,
        read_size: int = 8 * MiB,
        readahead_bytes: int = 512 * MiB,
        workers: int = 64,
        max_attempts: int = 8,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        check_timeout: float = 3.0,
        read_engine: str = "auto",
    ) -> None:
        super().__init__(config, rank)
        self.store = S3Store(
            config,
            part_size=part_size,
            parts_in_flight=parts_in_flight,
            read_size=read_size,
            readahead_bytes=readahead_bytes,
            workers=workers,
            max_attempts=max_attempts,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            check_timeout=check_timeout,
            read_engine=read_engine,
        )
        self.bucket = self.store.bucket
        self.prefix = self.store.prefix
        self.endpoint_url = self.store.endpoint_url
        self._reachable = True
        self.compresses = config.compression != "off"
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def decode_pool(self) -> ThreadPoolExecutor:
        """The threads that decode compressed objects' chunks (made at the first one): not the
        connection pool, whose threads the decodes wait on."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(os.cpu_count() or 1, f"tierd-decode-{self.name}")
            return self._pool

    def _places(self, relpath: str) -> tuple[str, str]:
        """The plain and the compressed key of ``relpath``."""
        return self.store.key(relpath), self.store.key(relpath, compressed=True)

    def _keys(self, relpath: str) -> tuple[str, str]:
        """The keys of ``relpath`` in the order to look for it: its likelier place first."""
        plain, packed = self._places(relpath)
        return (packed, plain) if self.compresses else (plain, packed)

    def _is_packed(self, key: str) -> bool:
        return key.startswith(f"{self.store.key_prefix()}{COMPRESSED_DIR}/")

    def _find(self, relpath: str) -> tuple[str, dict[str, Any]] | None:
        """The key ``relpath`` is stored at and its HEAD, or None."""
        for key in self._keys(relpath):
            head = self.store.head(key)
            if head is not None:
                return key, head
        return None

    def _source(self, relpath: str, key: str, st: Stat) -> ObjectSource:
        if self._is_packed(key):
            pool = self.decode_pool()
            return CompressedObjectSource(self, self.store, relpath, key, st, pool)
        return ObjectSource(self, self.store, relpath, key, st)

    @property
    def location(self) -> str:
        url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        return f"{url} at {self.endpoint_url}" if self.endpoint_url else url

    def origin_bytes_read(self) -> int:
        return self.store.bytes_read

    # -- life --------------------------------------------------------------------------------
    def check(self) -> None:
        """Write and delete a probe object under the prefix, so a bad configuration fails at
        start with the bucket and the reason named."""
        client = self.store.quick()
        pfx = self.store.key_prefix()
        probe = f"{pfx}{_PROBE}{secrets.token_hex(8)}{TEMP_SUFFIX}"
        try:
            client.put_object(Bucket=self.bucket, Key=probe, Body=b"tierd probe")
            client.delete_object(Bucket=self.bucket, Key=probe)
            # Probes of checks that crashed between their put and delete.
            old = client.list_objects_v2(Bucket=self.bucket, Prefix=f"{pfx}{_PROBE}")
            for obj in old.get("Contents", []):
                if obj["Key"].endswith(TEMP_SUFFIX):
                    client.delete_object(Bucket=self.bucket, Key=obj["Key"])
        except (ClientError, BotoCoreError) as exc:
            raise unavailable(self.name, self.bucket, self.endpoint_url, exc) from exc

    def reachable(self) -> bool:
        """One quick listing of at most one key under the prefix (reads only). A change of
        state is logged once, not on every poll."""
        try:
            self.store.quick().list_objects_v2(
                Bucket=self.bucket, Prefix=self.store.key_prefix(), MaxKeys=1
            )
        except (ClientError, BotoCoreError) as exc:
            if self._reachable:
                self._reachable = False
                why = unavailable(self.name, self.bucket, self.endpoint_url, exc)
                log.warning("tier %s is unreachable: %s", self.name, why)
            return False
        if not self._reachable:
            self._reachable = True
            log.warning("tier %s is reachable again", self.name)
        return True

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self.store.close()

    def space(self) -> Space:
        """A bucket has no capacity to report; a configured quota is the only bound."""
        return Space(None, None, UNBOUNDED)

    # -- files -------------------------------------------------------------------------------
    def open(
        self, relpath: str, *, etag: str | None = None, known: Stat | None = None
    ) -> ObjectSource:
        plain, packed = self._places(relpath)
        if etag is not None and known is not None and (known.codec is None or known.stored_size):
            # Every GET sends If-Match with this ETag: the HEAD would only repeat that check.
            version = strip_etag(etag)
            size = known.size if known.codec is None else int(known.stored_size or 0)
            st = Stat(size, known.mtime_ns, version, checksum=known.checksum, etag=version)
            return self._source(relpath, plain if known.codec is None else packed, st)
        found = self._find(relpath)
        if found is None:
            raise FileNotFound(f"no object {relpath!r} in tier {self.name}", path=relpath)
        key, head = found
        st = self.store.stat_of(head)
        if etag is not None and strip_etag(etag) != st.version:
            raise FileChanged(
                f"{relpath!r} in tier {self.name} changed behind tierd's back: its ETag is "
                f"{st.version}, the catalog has {strip_etag(etag)}",
                path=relpath,
                etag=st.version,
                expected=strip_etag(etag),
            )
        return self._source(relpath, key, st)

    def stat(self, relpath: str) -> Stat | None:
        """The object's stat; a compressed one's is its logical file's (its footer read)."""
        try:
            found = self._find(relpath)
        except InvalidPath:
            return None
        if found is None:
            return None
        key, head = found
        st = self.store.stat_of(head)
        if not self._is_packed(key):
            return st
        try:
            with self._source(relpath, key, st) as src:
                return src.stat
        except FileChanged:
            return self.stat(relpath)  # replaced between the HEAD and the footer's GET

    def walk(self) -> Iterator[WalkEntry]:
        """Every object under the prefix, skipping directory markers, tierd's temp and probe
        names, and keys that are not valid relpaths or not under the prefix (with a warning).
        In relpath order whatever order the store lists in (:mod:`tiering.tiers._listing`:
        sorted in bounded memory; the whole listing is read before the first entry comes).
        Compressed objects are listed from their own directory, merged into that order (their
        entries' ``size`` is the stored size, ``codec`` says so)."""
        pfx = self.store.key_prefix()
        return merged_walk(
            in_relpath_order(self._list(pfx, None)),
            in_relpath_order(self._list(f"{pfx}{COMPRESSED_DIR}/", CODEC)),
        )

    def _list(self, pfx: str, codec: str | None) -> Iterator[WalkEntry]:
        packed = f"{COMPRESSED_DIR}/"
        pages = self.store.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=pfx
        )
        try:
            for page in pages:
                for obj in page.get("Contents", []):
                    if not obj["Key"].startswith(pfx):  # a store that ignored Prefix
                        log.warning(
                            "skipping %r in tier %s: not under its prefix %r",
                            obj["Key"],
                            self.name,
                            pfx,
                        )
                        continue
                    rel = obj["Key"][len(pfx) :]
                    if not rel or rel.endswith("/") or rel.endswith(TEMP_SUFFIX):
                        continue
                    if codec is None and rel.startswith(packed):
                        continue  # the other listing's
                    try:
                        validate_relpath(rel)
                    except InvalidPath as exc:
                        log.warning("skipping %r in tier %s: %s", rel, self.name, exc)
                        continue
                    yield WalkEntry(
                        rel,
                        int(obj["Size"]),
                        mtime_ns(obj["LastModified"]),
                        etag=strip_etag(obj["ETag"]),
                        codec=codec,
                    )
        except (ClientError, BotoCoreError) as exc:
            raise translate(self.name, "list", self.store.url_of(pfx), exc) from exc

    def writer(
        self,
        relpath: str,
        *,
        overwrite: bool = False,
        limit: int | None = None,
        temp_stem: str | None = None,
        checksum: str | None = None,
    ) -> Writer:
        """A multipart upload of ``relpath``; on a compressing tier, fed by the encoder and
        started at its decision (see :mod:`tiering.tiers._object_z`)."""
        plain, packed = self._places(relpath)
        if not self.compresses:
            return ObjectWriter(
                self,
                self.store,
                relpath,
                key=plain,
                other=packed,
                overwrite=overwrite,
                limit=limit,
                temp_stem=temp_stem,
                checksum=checksum,
            )
        if not overwrite:
            ObjectWriter.refuse_existing(self, self.store, relpath, (plain, packed))

        def upload(compressed: bool) -> ObjectWriter:
            key, other = (packed, plain) if compressed else (plain, packed)
            return ObjectWriter(
                self,
                self.store,
                relpath,
                key=key,
                other=other,
                overwrite=overwrite,
                limit=limit,
                temp_stem=temp_stem,
                # The parts are the stored bytes: the checksum (of the logical ones) is checked
                # by the compressing writer, and kept in the metadata.
                checksum=None if compressed else checksum,
                label=checksum,
            )

        def room(n: int) -> None:
            refuse_over_limit(self, limit, n)

        return CompressingWriter(self, relpath, checksum, upload, room=room, read_back=False)

    def remove(
        self,
        relpath: str,
        *,
        version: str | None = None,
        between: Callable[[], None] | None = None,
    ) -> bool:
        """Delete the object; with ``version``, only while it still has that ETag (checked by
        HEAD and again by the conditional delete). A delete is durable when it returns, so
        ``between`` runs right after it."""
        found = self._find(relpath)
        if found is None:
            return False
        key, head = found
        if version is not None and strip_etag(version) != strip_etag(head["ETag"]):
            # The version may be the object at the other place (both there after an
            # interrupted overwrite): that is the one to remove.
            other = next(k for k in self._keys(relpath) if k != key)
            head = self.store.head(other) or head
            key = other if strip_etag(head["ETag"]) == strip_etag(version) else key
        current = strip_etag(head["ETag"])
        if version is not None and strip_etag(version) != current:
            log.warning(
                "not removing %r on tier %s: it is not the object that was moved "
                "(ETag %s, expected %s)",
                relpath,
                self.name,
                current,
                strip_etag(version),
            )
            return False
        if version is None:
            self.store.delete(key)
        elif not self.store.delete_exact(key, current):
            log.warning("not removing %r on tier %s: it changed during removal", relpath, self.name)
            return False
        if between is not None:
            between()
        return True

    def remove_temp(self, relpath: str, temp_stem: str) -> bool:
        """Abort every unfinished upload of ``relpath``'s key. By the ownership rule (module
        docstring) they are all the temp of the one move that writes that key, so
        ``temp_stem`` (not listed by S3) need not be matched."""
        found = False
        for key in self._keys(relpath):
            for up in list(self.store.uploads(key)):
                if up["Key"] == key:
                    self.store.abort_upload(key, up["UploadId"])
                    found = True
        return found

    def temps(self) -> Iterator[tuple[str, str]]:
        """``(relpath, "")`` for each key under the prefix with unfinished uploads."""
        seen: set[str] = set()
        packed = f"{COMPRESSED_DIR}/"
        for up in self.store.uploads(self.store.key_prefix()):
            rel = self.store.relpath_of(up["Key"])
            rel = rel[len(packed) :] if rel.startswith(packed) else rel
            if rel in seen:
                continue
            seen.add(rel)
            try:
                validate_relpath(rel)
            except TierdError:
                log.warning("unfinished upload %r in tier %s is not a relpath", rel, self.name)
                continue
            yield rel, ""
