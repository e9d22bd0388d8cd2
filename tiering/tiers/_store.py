"""The connection to one bucket prefix: the boto3 clients, the thread pool, and the requests an
object-store tier and its readers and writers make, with botocore's errors turned into tierd's.

:class:`S3Store` knows keys and ETags, not tiers: :mod:`tiering.tiers._object` builds the
:class:`~tiering.tiers.Tier` on it, and :mod:`tiering.tiers._object_io` its readers and writers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from tiering.config import TierConfig
from tiering.errors import FileChanged
from tiering.ranges import KvikioMode, KvikioReads, Rings
from tiering.tiers._base import Stat
from tiering.tiers._obstore import ObstoreGets, obstore_module, usable_here
from tiering.tiers._s3 import (
    STREAM_ERRORS,
    backoff,
    error_code,
    error_status,
    gave_up,
    make_client,
    mtime_ns,
    parse_endpoint,
    parse_url,
    quote_etag,
    strip_etag,
    translate,
)
from tiering.tiers.paths import COMPRESSED_DIR, validate_relpath

__all__ = ["META_CHECKSUM", "MiB", "S3Store"]

log = logging.getLogger(__name__)

MiB = 1 << 20
#: The object metadata that holds tierd's content checksum (``x-amz-meta-tierd-checksum``).
META_CHECKSUM = "tierd-checksum"
# A GET body is read in steps of this size: urllib3 allocates each step before copying it into
# the caller's buffer, so a step bounds that extra memory per request.
_READ_STEP = 1 * MiB
#: What reads an object in order for a promotion: ``"auto"`` (KvikIO's ``RemoteFile`` where it
#: is installed with remote I/O, else the tier's GETs), ``"kvikio"`` (required) or ``"boto3"``
#: (never KvikIO, and botocore's GETs rather than obstore's).
ENGINES = ("auto", "kvikio", "boto3")


class S3Store:
    """A bucket prefix and the means to reach it (see :class:`~tiering.tiers.ObjectTier` for
    the tuning arguments). ``name`` is the tier's, for messages."""

    def __init__(
        self,
        config: TierConfig,
        *,
        part_size: int,
        parts_in_flight: int,
        read_size: int,
        readahead_bytes: int,
        workers: int,
        max_attempts: int,
        connect_timeout: float,
        read_timeout: float,
        check_timeout: float,
        read_engine: str = "auto",
    ) -> None:
        self.name = config.name
        self.bucket, self.prefix = parse_url(config.name, config.url)
        self.endpoint_url = parse_endpoint(config.name, config.endpoint_url)
        self.region = config.region
        if read_engine not in ENGINES:
            raise ValueError(f"tier {config.name!r}: read_engine must be one of {ENGINES}")
        if min(part_size, read_size, parts_in_flight, workers, max_attempts) < 1:
            raise ValueError(f"tier {config.name!r}: sizes and counts must be positive")
        self.part_size = part_size
        self.parts_in_flight = parts_in_flight
        self.read_size = read_size
        self.readahead_bytes = readahead_bytes
        self.workers = workers
        self.rings = Rings(readahead_bytes + read_size)  # a promotion's ring, kept for the next
        self.read_engine = read_engine
        mode: KvikioMode = "kvikio" if read_engine == "kvikio" else "auto"
        try:  # asked for by name: refused now, not at the first move
            self.kvikio = KvikioReads(
                "never" if read_engine == "boto3" else mode,
                threads=workers,
                expires_s=3600,
            )
        except ImportError as exc:
            raise ValueError(
                f"tier {config.name!r}: read engine 'kvikio' is not usable here: {exc}"
            ) from exc
        self.max_attempts = max_attempts
        self.check_timeout = check_timeout
        self.client: Any = make_client(
            self.endpoint_url,
            self.region,
            pool=workers + 16,
            max_attempts=max_attempts,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix=f"tierd-s3-{config.name}")
        #: Bytes read from the bucket by ranged reads (loads, promotions, fills), for metrics.
        self.bytes_read = 0
        self._count_lock = threading.Lock()
        #: Presigned GET URLs by (key, ETag): see :meth:`ObjectRanges.url
        #: <tiering.tiers._object_reads.ObjectRanges.url>`.
        self.urls = UrlCache()
        # Ranged GETs through obstore where it is installed (a third of botocore's CPU per
        # byte, see tiering.tiers._obstore), unless the tier asked for botocore by name.
        self._obstore = obstore_module() if read_engine != "boto3" else None
        self._gets: ObstoreGets | None = None
        self._gets_args: dict[str, Any] = {
            "tier": config.name,
            "bucket": self.bucket,
            "endpoint_url": self.endpoint_url,
            "region": self.region,
            "connections": workers + 16,
            "max_attempts": max_attempts,
            "connect_timeout": connect_timeout,
            "read_timeout": read_timeout,
        }
        #: Who sends the tier's ranged GETs: "obstore" or "botocore".
        self.get_engine = "obstore" if self._obstore is not None else "botocore"
        self._closed = False
        self._lock = threading.Lock()
        self._quick_client: Any = None

    # -- keys --------------------------------------------------------------------------------
    def key(self, relpath: str, *, compressed: bool = False) -> str:
        """The object key of ``relpath`` (validated); ``compressed``: of its container, in the
        reserved directory (:mod:`tiering.tiers._object_z`)."""
        validate_relpath(relpath)
        name = f"{COMPRESSED_DIR}/{relpath}" if compressed else relpath
        return f"{self.prefix}/{name}" if self.prefix else name

    def key_prefix(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    def relpath_of(self, key: str) -> str:
        return key[len(self.key_prefix()) :]

    def url_of(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    # -- requests ----------------------------------------------------------------------------
    def call(self, action: str, where: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """``fn(**kwargs)`` with botocore's errors (after its retries) as tierd's."""
        try:
            return fn(**kwargs)
        except (ClientError, BotoCoreError) as exc:
            raise translate(self.name, action, where, exc) from exc

    def head(self, key: str) -> dict[str, Any] | None:
        """HEAD of ``key``, or None when there is no such object."""
        try:
            return dict(self.client.head_object(Bucket=self.bucket, Key=key))
        except ClientError as exc:
            if error_status(exc) == 404 or error_code(exc) in ("404", "NoSuchKey"):
                return None
            raise translate(self.name, "stat", self.url_of(key), exc) from exc
        except BotoCoreError as exc:
            raise translate(self.name, "stat", self.url_of(key), exc) from exc

    def stat_of(self, head: dict[str, Any]) -> Stat:
        etag = strip_etag(head["ETag"])
        return Stat(
            int(head["ContentLength"]),
            mtime_ns(head["LastModified"]),
            etag,
            checksum=head.get("Metadata", {}).get(META_CHECKSUM),
            etag=etag,
        )

    def count_read(self, nbytes: int) -> None:
        """Add ``nbytes`` read from the bucket to :attr:`bytes_read`."""
        with self._count_lock:
            self.bytes_read += nbytes

    def get_into(self, key: str, version: str, view: memoryview, start: int) -> None:
        """Fill ``view`` with the bytes at ``start`` of ``key`` at ETag ``version``.

        Through obstore where it is installed (:mod:`tiering.tiers._obstore`), else botocore:
        botocore retries the request until the headers arrive; a body that breaks or stalls
        after that is resumed here from the last byte received, with backoff and jitter.
        """
        where = self.url_of(key)
        gets = self._obstore_gets()
        if gets is not None:
            gets.get_into(key, version, view, start, where)
            return
        n, pos, attempt = len(view), 0, 0
        while pos < n:
            try:
                resp = self.client.get_object(
                    Bucket=self.bucket,
                    Key=key,
                    Range=f"bytes={start + pos}-{start + n - 1}",
                    IfMatch=quote_etag(version),
                )
            except ClientError as exc:
                # (Not any 404: a vanished bucket is NoSuchBucket, and the tier's problem.)
                if error_status(exc) == 412 or error_code(exc) in (
                    "NoSuchKey",
                    "PreconditionFailed",
                ):
                    raise self._changed(key, version) from None
                raise translate(self.name, "read", where, exc) from exc
            except BotoCoreError as exc:
                raise translate(self.name, "read", where, exc) from exc
            body = resp["Body"]
            try:
                while pos < n:
                    got = body.readinto(view[pos : min(n, pos + _READ_STEP)])
                    if not got:
                        raise ConnectionError("the body ended early")
                    pos += got
            except STREAM_ERRORS as exc:
                attempt += 1
                if attempt >= self.max_attempts:
                    raise gave_up(self.name, where, attempt, exc) from exc
                log.info("tier %s: resuming a read of %s after %s", self.name, where, exc)
                time.sleep(backoff(attempt))
            finally:
                body.close()

    def unchanged(self, key: str, version: str, size: int) -> bool:
        """Whether ``key`` still holds ETag ``version`` and ``size`` bytes (one HEAD, through
        obstore where it is installed, as :meth:`get_into`)."""
        gets = self._obstore_gets()
        if gets is not None:
            return gets.same(key, version, size, self.url_of(key))
        head = self.head(key)
        if head is None:
            return False
        now = self.stat_of(head)
        return (now.version, now.size) == (version, size)

    def _obstore_gets(self) -> ObstoreGets | None:
        """obstore's client, made at the first GET: it takes the credentials the AWS chain has
        then. None without obstore, or while the chain has no credentials (botocore's request
        then fails with the tier's usual ``no_credentials``)."""
        if self._obstore is None:
            return None
        if not usable_here():  # a child forked after the runtime started: botocore
            return None
        if self._gets is not None:
            return self._gets
        with self._lock:
            if self._gets is None:
                try:
                    self._gets = ObstoreGets(
                        self._obstore, changed=self._changed, **self._gets_args
                    )
                except ValueError as exc:  # Boto3CredentialProvider: the chain found none
                    log.debug("tier %s: GETs by botocore for now: %s", self.name, exc)
        return self._gets

    def _changed(self, key: str, version: str) -> FileChanged:
        relpath = self.relpath_of(key)
        return FileChanged(
            f"{relpath!r} in tier {self.name} changed behind tierd's back (replaced or removed): "
            f"it no longer has ETag {version}",
            path=relpath,
            etag=version,
        )

    def delete(self, key: str) -> None:
        """Delete ``key`` whatever it holds (a missing key is no error: S3 answers 204)."""
        where = self.url_of(key)
        self.call("remove", where, self.client.delete_object, Bucket=self.bucket, Key=key)

    def delete_exact(self, key: str, version: str) -> bool:
        """Delete ``key`` only while it holds ETag ``version``; False if it did not."""
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key, IfMatch=quote_etag(version))
        except ClientError as exc:
            if error_status(exc) in (404, 412):
                return False
            if error_code(exc) != "NotImplemented":
                raise translate(self.name, "remove", self.url_of(key), exc) from exc
            # A store without conditional deletes: the HEAD just before must do.
            self.delete(key)
        except BotoCoreError as exc:
            raise translate(self.name, "remove", self.url_of(key), exc) from exc
        return True

    def abort_upload(self, key: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except ClientError as exc:
            if error_status(exc) != 404 and error_code(exc) != "NoSuchUpload":
                raise translate(self.name, "abort the upload of", self.url_of(key), exc) from exc
        except BotoCoreError as exc:
            raise translate(self.name, "abort the upload of", self.url_of(key), exc) from exc

    def uploads(self, prefix: str) -> Iterator[dict[str, Any]]:
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=prefix
        )
        try:
            for page in pages:
                yield from page.get("Uploads", [])
        except (ClientError, BotoCoreError) as exc:
            raise translate(self.name, "list the uploads of", self.url_of(prefix), exc) from exc

    def quick(self) -> Any:
        """A client with short timeouts and one retry, for the tier's ``check`` and
        ``reachable``: a misconfigured or unreachable store must fail fast, not after a minute
        of retries."""
        with self._lock:
            if self._quick_client is None:
                self._quick_client = make_client(
                    self.endpoint_url,
                    self.region,
                    pool=2,
                    max_attempts=2,
                    connect_timeout=self.check_timeout,
                    read_timeout=self.check_timeout * 2,
                )
            return self._quick_client

    def close(self) -> None:
        """Stop the pool (waiting for its requests) and close the connections; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()
        if self._quick_client is not None:
            self._quick_client.close()


class UrlCache:
    """Presigned GET URLs of object versions, kept for a quarter of their life (a reader that
    renews at half its own is then never handed one about to expire), so repeated loads of
    one object sign and HEAD it once, not every time (a HEAD and a signature are a few ms of a
    load that takes tens). At most ``size`` entries; the oldest go first."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._urls: dict[tuple[str, str], tuple[str, float]] = {}

    def get(self, key: str, version: str) -> str | None:
        with self._lock:
            hit = self._urls.get((key, version))
            if hit is None or time.monotonic() >= hit[1]:
                return None
            return hit[0]

    def put(self, key: str, version: str, url: str, expires_s: int) -> None:
        with self._lock:
            self._urls.pop((key, version), None)
            self._urls[(key, version)] = (url, time.monotonic() + expires_s / 4)
            while len(self._urls) > self.size:
                del self._urls[next(iter(self._urls))]
