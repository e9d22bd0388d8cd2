"""An object's bytes as a :class:`~tiering.ranges.RangeReader`: ranged GETs pinned to the ETag
opened, and a presigned URL for KvikIO's ``RemoteFile``.

Every GET is one :meth:`S3Store.get_into <tiering.tiers._store.S3Store.get_into>`, the one
place that picks obstore (where installed) or botocore, with ``If-Match`` on the ETag, so a
replaced object raises :class:`~tiering.errors.FileChanged` rather than mixing two versions.
Longer ranges go out as parallel GETs of ``read_size`` on the tier's pool.

KvikIO knows no AWS credentials: :meth:`ObjectRanges.url` presigns a GET URL with boto3 (any
link of the AWS chain, any S3-protocol store), and KvikIO or tierd's own connections open it
as plain HTTP. tierd's send :meth:`ObjectRanges.pins` (``If-Match``) with every GET; KvikIO
cannot, so a read through it calls :meth:`ObjectRanges.check_unchanged` once its bytes are in.
"""

from __future__ import annotations

from typing import Any

from tiering.ranges import RangeReader
from tiering.tiers._base import Stat
from tiering.tiers._s3 import quote_etag
from tiering.tiers._store import S3Store

__all__ = ["ObjectRanges"]


class ObjectRanges(RangeReader):
    """The object at ``key`` of ``store``, pinned to the ETag of ``stat``."""

    serves_url = True

    def __init__(self, store: S3Store, key: str, stat: Stat) -> None:
        super().__init__(
            store.url_of(key), stat.size, stat.version, pool=store.pool, part_size=store.read_size
        )
        self.store = store
        self.key = key

    def get(self, view: memoryview, offset: int) -> None:
        self.store.get_into(self.key, self.version, view, offset)
        self.store.count_read(len(view))

    def pins(self) -> dict[str, str]:
        """``If-Match`` on the ETag opened: a GET of :meth:`url` that sends it gets 412, not
        another version's bytes (tierd's own connections send it; KvikIO cannot)."""
        return {"If-Match": quote_etag(self.version)}

    def read_by_url(self, nbytes: int) -> None:
        self.store.count_read(nbytes)

    def url(self, expires_s: int) -> str:
        """A presigned GET URL of the object, valid for ``expires_s`` seconds.

        It lets an engine that knows no AWS credentials (libcurl in KvikIO's ``RemoteFile``)
        read the object with plain ranged GETs, whatever link of the AWS chain (environment,
        shared files, instance role) boto3 found the credentials in, on any S3-protocol store.
        Query-string auth signs the host only, so any ``Range`` header may be sent. Such a
        reader cannot send ``If-Match``: it must call :meth:`check_unchanged` once its bytes
        are in. Where the bucket keeps versions the URL names the version opened (when the
        HEAD now still shows the ETag opened), so those bytes are exactly the ones opened.

        A URL is signed once per object version and reused for a quarter of its life (the store's
        :class:`~tiering.tiers._store.UrlCache`): a reader of a cached URL skips the HEAD
        here, and the HEAD of :meth:`check_unchanged` after its read still catches a
        replaced object.
        """
        cached = self.store.urls.get(self.key, self.version)
        if cached is not None:
            return cached
        params: dict[str, Any] = {"Bucket": self.store.bucket, "Key": self.key}
        head = self.head_matches()  # a replaced object gets no URL
        if head is None:
            raise self.store._changed(self.key, self.version)
        vid = head.get("VersionId")
        if vid and vid != "null":
            params["VersionId"] = str(vid)
        url = str(
            self.store.call(
                "presign a read of",
                self.name,
                self.store.client.generate_presigned_url,
                ClientMethod="get_object",
                Params=params,
                ExpiresIn=int(expires_s),
            )
        )
        self.store.urls.put(self.key, self.version, url, expires_s)
        return url

    def check_unchanged(self) -> None:
        """Raise :class:`~tiering.errors.FileChanged` unless the key still holds the ETag and
        size opened: the check after a read that could not send ``If-Match``.

        S3 objects are immutable per version, so the bytes of one GET are of one version; a
        read made of many GETs mixes two only if the key was overwritten during it, and then
        this HEAD, sent after the last GET ended, shows the new ETag (S3 reads after writes
        are strongly consistent). The caller discards its buffer.
        """
        if not self.store.unchanged(self.key, self.version, self.size):
            raise self.store._changed(self.key, self.version)

    def head_matches(self) -> dict[str, Any] | None:
        """The HEAD of the key when it still holds the ETag and size opened, else None."""
        head = self.store.head(self.key)
        if head is None:
            return None
        now = self.store.stat_of(head)
        return head if (now.version, now.size) == (self.version, self.size) else None
