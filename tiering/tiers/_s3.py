"""The S3 protocol pieces an object-store tier is built from: its URL, its boto3 client, and
how botocore's errors become tierd's.

Credentials never pass through here. boto3 resolves them from the standard AWS chain
(environment, shared config and credentials files, instance role) when the first request is
signed; nothing in this module reads, stores, logs or formats them, and an endpoint URL that
carries a user or password is refused.
"""

from __future__ import annotations

import calendar
import random
import re
import threading
import urllib.parse
from datetime import datetime
from typing import Any

import boto3
import botocore.loaders
import botocore.session
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from urllib3.exceptions import HTTPError as URLLib3Error

from tiering.errors import StorageError, TierdError, TierUnavailable
from tiering.tiers.paths import validate_relpath

__all__ = [
    "STREAM_ERRORS",
    "backoff",
    "error_code",
    "error_status",
    "make_client",
    "mtime_ns",
    "parse_endpoint",
    "parse_url",
    "quote_etag",
    "strip_etag",
    "translate",
    "unavailable",
]

# Errors while reading a GET's body. botocore's retries end when the response headers arrive,
# so a connection that drops or stalls mid-body is not retried by botocore: the ranged read
# retries these itself, resuming where the body stopped.
STREAM_ERRORS: tuple[type[BaseException], ...] = (
    ReadTimeoutError,
    ResponseStreamingError,
    IncompleteReadError,
    ConnectionClosedError,
    URLLib3Error,
    OSError,
)

# One data loader for every client: it caches the parsed service model, which is most of the
# ~150 ms it takes to build an S3 client. It holds only botocore's bundled JSON, no secrets.
_LOADER = botocore.loaders.create_loader()
_CLIENT_LOCK = threading.Lock()

_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]$")

_BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
    "AuthorizationHeaderMalformed",
}
_DENIED = {"AccessDenied", "AllAccessDisabled", "403"}
_NO_BUCKET = {"NoSuchBucket"}


def parse_url(tier: str, url: str | None) -> tuple[str, str]:
    """``s3://bucket/prefix`` as (bucket, prefix without slashes at either end)."""
    if not url:
        raise ValueError(f"tier {tier!r} is an object tier and needs url = 's3://bucket/prefix'")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "s3":
        raise ValueError(f"tier {tier!r}: url {url!r} must start with s3://")
    if "@" in parts.netloc or parts.query or parts.fragment:
        raise ValueError(
            f"tier {tier!r}: url must be s3://bucket/prefix with no user, query or fragment; "
            "credentials come from the AWS chain, never from the url"
        )
    bucket = parts.netloc
    if not _BUCKET_RE.match(bucket):
        raise ValueError(
            f"tier {tier!r}: {bucket!r} is not a bucket name (3 to 255 letters, digits, "
            "'.', '-' or '_', starting and ending with a letter or digit)"
        )
    prefix = parts.path.strip("/")
    if prefix:
        try:
            validate_relpath(prefix)
        except TierdError as exc:
            raise ValueError(f"tier {tier!r}: prefix {prefix!r} is not usable: {exc}") from None
    return bucket, prefix


def parse_endpoint(tier: str, endpoint_url: str | None) -> str | None:
    """A checked ``http(s)://host[:port]`` endpoint, or None for AWS's own."""
    if not endpoint_url:
        return None
    parts = urllib.parse.urlsplit(endpoint_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"tier {tier!r}: endpoint_url must be http(s)://host[:port]")
    if parts.username is not None or parts.password is not None:
        # Never keep a secret in a URL that is shown in `tierd tiers` and in errors.
        raise ValueError(
            f"tier {tier!r}: endpoint_url must not carry a user or password; credentials come "
            "from the AWS chain (environment, shared files, instance role)"
        )
    return endpoint_url.rstrip("/")


def make_client(
    endpoint_url: str | None,
    region: str | None,
    *,
    pool: int,
    max_attempts: int,
    connect_timeout: float,
    read_timeout: float,
) -> Any:
    """A thread-safe S3 client on a fresh credential chain.

    ``retries`` standard mode retries with exponential backoff and full jitter: HTTP 500, 502,
    503 and 504, throttling codes (SlowDown, Throttling, RequestLimitExceeded...),
    RequestTimeout, and connection failures before a response (refused, reset, closed, connect
    and read timeouts) — every request, as long as its body can be resent (ours are bytes).
    """
    config = Config(
        retries={"mode": "standard", "total_max_attempts": max_attempts},
        max_pool_connections=pool,
        tcp_keepalive=True,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        # SigV4 everywhere, presigned URLs included (botocore would presign with SigV2, which
        # newer regions and many S3-compatible stores refuse).
        signature_version="s3v4",
        # Path-style works with every S3-compatible server and with dotted bucket names.
        s3={"addressing_style": "path"} if endpoint_url else None,
    )
    with _CLIENT_LOCK:
        core = botocore.session.Session()
        core.register_component("data_loader", _LOADER)
        session = boto3.session.Session(botocore_session=core, region_name=region)
        return session.client("s3", endpoint_url=endpoint_url, config=config)


def strip_etag(etag: str) -> str:
    """An ETag without its quotes: the form tierd stores and compares."""
    return etag.strip('"')


def quote_etag(etag: str) -> str:
    """An ETag as an ``If-Match`` header wants it."""
    return f'"{strip_etag(etag)}"'


def mtime_ns(when: datetime) -> int:
    """Whole seconds: HEAD's Last-Modified has no finer grain, so a listing's milliseconds are
    dropped too and the same object always has the same mtime."""
    return calendar.timegm(when.utctimetuple()) * 1_000_000_000


def backoff(attempt: int, base: float = 0.05, cap: float = 2.0) -> float:
    """Full-jitter exponential backoff, as botocore's standard mode uses."""
    return random.random() * min(cap, base * 2.0**attempt)


def error_code(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", "") or "")
    return type(exc).__name__


def error_status(exc: BaseException) -> int | None:
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(status) if status is not None else None
    return None


def _reason(exc: BaseException) -> tuple[str, str] | None:
    """(reason code, sentence) for the failures that make a whole tier unusable."""
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return (
            "no_credentials",
            "no credentials found in the AWS chain (environment, shared config and "
            "credentials files, instance role)",
        )
    code, status = error_code(exc), error_status(exc)
    if code in _BAD_CREDENTIALS:
        return "bad_credentials", f"bad credentials ({code}): check the access key and secret"
    if code in _NO_BUCKET:
        return "no_such_bucket", "no such bucket"
    if code in _DENIED or status == 403:
        return (
            "access_denied",
            f"access denied ({code or 403}): the credentials may not write there",
        )
    if isinstance(exc, BotoConnectionError | HTTPClientError):
        return "unreachable", f"endpoint unreachable ({type(exc).__name__})"
    if status is not None and (status >= 500 or code in ("SlowDown", "Throttling")):
        return "unavailable", f"the store keeps failing (HTTP {status} {code}) after retries"
    return None


def unavailable(
    tier: str, bucket: str, endpoint: str | None, exc: BaseException
) -> TierUnavailable:
    """The error :meth:`ObjectTier.check` raises: it names the tier, bucket and reason."""
    reason = _reason(exc)
    code, sentence = reason or (
        "unexpected",
        f"unexpected error {error_code(exc)} (HTTP {error_status(exc) or '-'})",
    )
    where = endpoint or "AWS"
    return TierUnavailable(
        f"object-store tier {tier!r} cannot use bucket {bucket!r} at {where}: {sentence}",
        tier=tier,
        bucket=bucket,
        reason=code,
    )


def gave_up(tier: str, where: str, attempts: int, exc: BaseException) -> TierUnavailable:
    """The error of a read that failed ``attempts`` times in a row (the last with ``exc``)."""
    return TierUnavailable(
        f"tier {tier}: read {where} failed {attempts} times, last with {type(exc).__name__}",
        tier=tier,
        reason="unavailable",
    )


def translate(tier: str, action: str, where: str, exc: BaseException) -> TierdError:
    """A failed request (after botocore's retries) as tierd's error. ``where`` is an s3:// URL."""
    if isinstance(exc, TierdError):
        return exc
    reason = _reason(exc)
    if reason is not None:
        return TierUnavailable(
            f"tier {tier}: {action} {where} failed: {reason[1]}", tier=tier, reason=reason[0]
        )
    if isinstance(exc, ClientError | BotoCoreError):
        return StorageError(
            f"tier {tier}: {action} {where} failed: {error_code(exc)} "
            f"(HTTP {error_status(exc) or '-'})",
            tier=tier,
            code=error_code(exc),
        )
    return StorageError(f"tier {tier}: {action} {where} failed: {exc}", tier=tier)
