"""Ranged GETs of an object tier through obstore (Rust's ``object_store``), where it is installed.

Where KvikIO is not there to read objects (a host without CUDA, or the small ranged reads
that stay in Python), every ranged GET of an object tier is one :meth:`ObstoreGets.get_into`.
botocore's GETs cost a 2-core host about 1 CPU-second per GB read (urllib3 reads each body
through Python in steps, allocating each step before copying it out); obstore's cost 0.67, and
on the S3-like origin at 16 connections a 256 MiB read went from 1.0 to 1.5 GB/s. The
request, its signature, its retries and the body live in Rust threads without the GIL; Python
copies each finished range into the caller's buffer once.

The credentials are botocore's: obstore asks the same boto3 session (the AWS chain:
environment, shared files, instance role) through its ``Boto3CredentialProvider``, so the two
clients of a tier never disagree about who is asking. ``If-Match`` goes with every GET, so a
replaced object is a :class:`~tiering.errors.FileChanged`, as with botocore.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from types import ModuleType
from typing import Any

from tiering.errors import FileChanged, StorageError, TierUnavailable
from tiering.tiers._s3 import backoff, gave_up, quote_etag, strip_etag

__all__ = ["ObstoreGets", "obstore_module", "usable_here"]

log = logging.getLogger(__name__)


#: The process whose obstore runtime has started (None: not yet). obstore runs its requests on
#: a tokio runtime started at its first call, and that runtime does not survive fork(): a
#: child forked after it started (a DataLoader worker, a test's crash child) would wait forever
#: on its first GET, so such a child reads with botocore instead.
_started_in: int | None = None


def obstore_module() -> ModuleType | None:
    """obstore with its boto3 credential bridge, or None where it is not installed or cannot
    run in this process (forked after the parent's obstore runtime started)."""
    if not usable_here():
        return None
    try:
        importlib.import_module("obstore.auth.boto3")
        return importlib.import_module("obstore")
    except ImportError:
        return None


def usable_here() -> bool:
    """False in a process forked after its parent's obstore runtime started."""
    return _started_in is None or _started_in == os.getpid()


class ObstoreGets:
    """Ranged GETs of one bucket through obstore (see the module's docstring).

    ``max_attempts`` bounds the tries of one range (a 5xx, a dropped connection, a timeout or
    a body that broke: each is tried again, with backoff); ``connections`` is its idle pool;
    ``changed(key, etag)`` is the error for an object that no longer has the ETag read at.
    """

    def __init__(
        self,
        obs: ModuleType,
        *,
        tier: str,
        bucket: str,
        endpoint_url: str | None,
        region: str | None,
        connections: int,
        max_attempts: int,
        connect_timeout: float,
        read_timeout: float,
        changed: Callable[[str, str], FileChanged],
    ) -> None:
        store_mod = importlib.import_module("obstore.store")
        auth = importlib.import_module("obstore.auth.boto3")
        boto3 = importlib.import_module("boto3")
        self.tier = tier
        self.max_attempts = max_attempts
        self._changed = changed
        self._obs = obs
        self._errors = importlib.import_module("obstore.exceptions")
        session = boto3.Session(region_name=region) if region else boto3.Session()
        kwargs: dict[str, Any] = {
            "region": region or session.region_name or "us-east-1",
            "client_options": {
                "allow_http": bool(endpoint_url and endpoint_url.startswith("http://")),
                "connect_timeout": timedelta(seconds=connect_timeout),
                "read_timeout": timedelta(seconds=read_timeout),
                "pool_max_idle_per_host": str(connections),
            },
            # One retry policy, ours (get_into): obstore retrying too would multiply the tries.
            "retry_config": {"max_retries": 0},
        }
        if endpoint_url:
            # Path-style, as botocore's client here: any S3-compatible server, dotted buckets.
            kwargs["endpoint"] = endpoint_url
            kwargs["virtual_hosted_style_request"] = False
        self._store = store_mod.S3Store(
            bucket, credential_provider=auth.Boto3CredentialProvider(session), **kwargs
        )

    def get_into(self, key: str, version: str, view: memoryview, start: int, where: str) -> None:
        """Fill ``view`` with the bytes at ``start`` of ``key`` at ETag ``version``."""
        n, pos = len(view), 0
        while pos < n:
            options = {"range": (start + pos, start + n), "if_match": quote_etag(version)}
            try:
                got = self._call("read", where, partial(self._get, key, options))
            except _Gone:
                raise self._changed(key, version) from None
            size = len(got)
            if size == 0 or size > n - pos:
                raise StorageError(
                    f"tier {self.tier}: read {where} at {start + pos} returned {size} bytes, "
                    f"{n - pos} asked for",
                    tier=self.tier,
                )
            view[pos : pos + size] = memoryview(got)
            pos += size

    def same(self, key: str, version: str, size: int, where: str) -> bool:
        """Whether ``key`` still holds ETag ``version`` and ``size`` bytes: one HEAD.

        The check after a read that could not send ``If-Match`` (KvikIO's). obstore's HEAD
        costs a fraction of botocore's (its signing and parsing in Python took about 2 ms of
        a 58 ms, 1 GiB load into a GPU), and it runs without the GIL.
        """
        try:
            meta = self._call("stat", where, lambda: self._obs.head(self._store, key))
        except _Gone:
            return False
        etag = meta.get("e_tag")
        return etag is not None and strip_etag(etag) == version and meta["size"] == size

    def _get(self, key: str, options: dict[str, Any]) -> Any:
        return self._obs.get(self._store, key, options=options).bytes()  # the body too

    def _call(self, action: str, where: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` (one request) with obstore's errors as tierd's: tried again, with backoff,
        after a 5xx, a refused or dropped connection, a timeout or a body cut short; a missing
        object or a failed ``If-Match`` raises :class:`_Gone`; a missing bucket or a refusal,
        the tier's :class:`~tiering.errors.TierUnavailable`."""
        global _started_in
        if _started_in is None:
            _started_in = os.getpid()
        errors = self._errors
        attempt = 0
        while True:
            try:
                return fn()
            except (errors.PreconditionError, errors.NotFoundError, FileNotFoundError) as exc:
                # obstore raises a 404 as FileNotFoundError. Not any 404: a vanished bucket is
                # NoSuchBucket, and the tier's problem, not the object's.
                if "NoSuchBucket" in str(exc):
                    raise TierUnavailable(
                        f"tier {self.tier}: {action} {where} failed: no such bucket",
                        tier=self.tier,
                        reason="no_such_bucket",
                    ) from None
                raise _Gone from None
            except (errors.PermissionDeniedError, errors.UnauthenticatedError) as exc:
                raise TierUnavailable(
                    f"tier {self.tier}: {action} {where} failed: access denied ({exc})",
                    tier=self.tier,
                    reason="access_denied",
                ) from exc
            except errors.BaseError as exc:
                attempt += 1
                if attempt >= self.max_attempts:
                    raise gave_up(self.tier, where, attempt, exc) from exc
                log.info("tier %s: retrying a %s of %s after %s", self.tier, action, where, exc)
                time.sleep(backoff(attempt))


class _Gone(Exception):
    """The object is not there, or no longer has the ETag asked for."""
