"""The REST calls behind :mod:`tierd_client.fsspec`, and the errors fsspec callers expect.

Lookups, prefix listings, ranged reads, streamed uploads and deletes, each one request. A bulk
operation (``copy``, ``rm``, ``get``, ``put``, ``cat_ranges``...) runs inside
:meth:`Remote.snapshot`: the first listing of a prefix, and each lookup, are kept until the
operation ends and answer later listings and lookups, kept current with this client's own
uploads and deletes. Outside an operation nothing is cached. fsspec is not imported here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import httpx

from ._exceptions import (
    APIError,
    AuthError,
    Conflict,
    InsufficientSpace,
    InvalidRequest,
    NotFound,
    RangeNotSatisfiable,
    error_from_response,
)
from ._tls import tls_context

__all__ = ["PAGE", "Remote", "os_error"]

PAGE = 1000  # the server's largest listing page
_NO_FILE = frozenset({"file_not_found", "not_found"})  # not tier_not_found: that is bad input

Record = dict[str, Any]


def os_error(exc: APIError, path: str, *, lookup: bool = False) -> Exception:
    """The exception fsspec callers expect for an error reply about ``path``.

    - no such file (404), or a lookup of a path tierd could never hold (400/422: the lookup's
      only input is the path) → ``FileNotFoundError``;
    - a write to such a path (``invalid_path``: empty, ``.``/``..`` components...) →
      ``OSError(EINVAL)`` with the server's reason;
    - 401/403 → ``PermissionError``; an existing file or directory on a create →
      ``FileExistsError``; 507 → ``OSError(ENOSPC)``;
    - anything else stays the client's :class:`APIError` (``tier_not_found``, ``file_busy``...).
    """
    if (isinstance(exc, NotFound) and exc.code in _NO_FILE) or (
        lookup and isinstance(exc, InvalidRequest)
    ):
        return FileNotFoundError(errno.ENOENT, exc.message, path)
    if isinstance(exc, InvalidRequest) and exc.code == "invalid_path":
        return OSError(errno.EINVAL, exc.message, path)
    if isinstance(exc, AuthError):
        return PermissionError(errno.EACCES, exc.message, path)
    if isinstance(exc, Conflict) and exc.code == "path_conflict":
        # A file named as a parent is POSIX's ENOTDIR; files below the name, its EEXIST.
        below = str(exc.details.get("conflict", "")).startswith(exc.details.get("path", "") + "/")
        if below:
            return FileExistsError(errno.EEXIST, exc.message, path)
        return NotADirectoryError(errno.ENOTDIR, exc.message, path)
    if isinstance(exc, Conflict) and exc.code == "already_exists":
        return FileExistsError(errno.EEXIST, exc.message, path)
    if isinstance(exc, InsufficientSpace):
        return OSError(errno.ENOSPC, exc.message, path)
    return exc


def _stale(path: str) -> OSError:
    return OSError(errno.ESTALE, "the file was replaced while it was open", path)


class _Operation:
    """What one bulk operation has seen: listings by prefix, records by path."""

    def __init__(self) -> None:
        self.listings: dict[str, dict[str, Record]] = {}
        self.found: dict[str, Record] = {}

    def covering(self, path: str) -> list[dict[str, Record]]:
        return [recs for p, recs in self.listings.items() if path.startswith(p)]


class Remote:
    """tierd's file routes for one filesystem: data token for reads and writes, admin token
    for deletes. Thread-safe: httpx's client is, and each thread has its own operation."""

    def __init__(
        self,
        url: str,
        token: str | None,
        admin_token: str | None,
        *,
        timeout: float,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._admin = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._options: dict[str, Any] = {
            "base_url": url,
            "timeout": timeout,
            "verify": tls_context(),
        }
        if transport is not None:
            self._options["transport"] = transport
        self._http = httpx.Client(**self._options)
        self._pid = os.getpid()
        self._local = threading.local()

    @property
    def http(self) -> httpx.Client:
        """This process's HTTP client. A forked child (a DataLoader or multiprocessing worker
        handed the filesystem) gets its own: sharing the parent's pooled connections would
        interleave two processes' requests on one socket."""
        if self._pid != os.getpid():
            self._http = httpx.Client(**self._options)  # the parent's is left alone, unclosed
            self._pid = os.getpid()
        return self._http

    def close(self) -> None:
        if self._pid == os.getpid():
            self._http.close()

    def request(
        self,
        method: str,
        url: str,
        path: str,
        *,
        admin: bool = False,
        lookup: bool = False,
        stream: bool = False,
        headers: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """One call; error replies become :func:`os_error`'s exceptions, an unreachable
        server a ``ConnectionError``. With ``stream``, the body is left unread (close it)."""
        hdrs = {**(self._admin if admin else self._auth), **(headers or {})}
        try:
            req = self.http.build_request(method, url, headers=hdrs, **kwargs)
            resp = self.http.send(req, stream=stream)
            if resp.status_code >= 400:
                resp.read()  # an error body is small JSON
        except httpx.HTTPError as exc:
            raise ConnectionError(f"{method} {url}: {exc}") from exc
        if resp.status_code >= 400:
            resp.close()
            raise os_error(error_from_response(resp), path, lookup=lookup)
        return resp

    @contextlib.contextmanager
    def stream(
        self, file_id: int, path: str, headers: dict[str, str] | None = None
    ) -> Iterator[httpx.Response]:
        """A file's content (or the range ``headers`` ask for) as a reply whose body is read
        in the block, and closed after it."""
        url = f"/v1/files/{file_id}/content"
        resp = self.request("GET", url, path, headers=headers, stream=True)
        try:
            yield resp
        except httpx.HTTPError as exc:  # the body broke off
            raise ConnectionError(f"GET {url}: {exc}") from exc
        finally:
            resp.close()

    # -- one listing per operation -----------------------------------------------------------
    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """Within the block, a prefix is listed once (see the module's docstring)."""
        if self._op() is not None:
            yield  # already inside an operation
            return
        self._local.op = _Operation()
        try:
            yield
        finally:
            self._local.op = None

    def _op(self) -> _Operation | None:
        return getattr(self._local, "op", None)

    def _fetch(self, prefix: str, limit: int | None) -> Iterator[Record]:
        params: dict[str, Any] = {"limit": min(limit or PAGE, PAGE)}
        if prefix:
            params["prefix"] = prefix
        while True:
            page = self.request("GET", "/v1/files", prefix, params=params).json()
            yield from page["items"]
            if page["next_cursor"] is None or limit is not None:
                return
            params["cursor"] = page["next_cursor"]

    def records(self, prefix: str, limit: int | None = None) -> Iterable[Record]:
        """The records of every file whose relpath starts with ``prefix`` (at least ``limit``
        of them, if there are that many, when ``limit`` is given)."""
        op = self._op()
        if op is None:
            return self._fetch(prefix, limit)
        for cached in op.covering(prefix):
            return [r for p, r in cached.items() if p.startswith(prefix)]
        recs = {r["path"]: r for r in self._fetch(prefix, None)}
        op.listings[prefix] = recs
        return list(recs.values())

    def lookup(self, path: str) -> Record:
        """The file record at ``path``; ``FileNotFoundError`` if no file is there."""
        if not path:
            raise FileNotFoundError(errno.ENOENT, "the root is a directory", path)
        op = self._op()
        if op is not None:
            if path in op.found:
                return op.found[path]
            for cached in op.covering(path):
                if path not in cached:
                    raise FileNotFoundError(errno.ENOENT, "no such file", path)
                return cached[path]
        params = {"path": path}
        rec: Record = self.request(
            "GET", "/v1/files/lookup", path, params=params, lookup=True
        ).json()
        if rec["state"] == "missing":
            raise FileNotFoundError(errno.ENOENT, "the file's bytes are gone (missing)", path)
        if op is not None:
            op.found[path] = rec
        return rec

    def lookup_or_none(self, path: str) -> Record | None:
        try:
            return self.lookup(path)
        except FileNotFoundError:
            return None

    def _record(self, path: str, rec: Record | None) -> None:
        """Keep the current operation's view current with this client's own change."""
        op = self._op()
        if op is None:
            return
        for cached in op.covering(path):
            if rec is None:
                cached.pop(path, None)
            else:
                cached[path] = rec
        if rec is None:
            op.found.pop(path, None)
        else:
            op.found[path] = rec

    # -- bytes -------------------------------------------------------------------------------
    def read(
        self,
        rec: Record,
        path: str,
        start: int | None,
        end: int | None,
        *,
        pinned: bool = False,
        etag: str | None = None,
    ) -> tuple[bytes, str | None]:
        """Bytes ``[start, end)`` (Python slice rules) of the file ``rec`` in one request, and
        the reply's ETag.

        With ``pinned`` (a file held open), the bytes must be those of the version ``rec``
        describes: the reply's ``Content-Range`` must give its size, and with ``etag`` the
        request carries ``If-Range``, which makes the server send a replaced file whole; either
        raises ``OSError(ESTALE)`` before the body is read.
        """
        size = rec["size"]
        lo, hi, _ = slice(start, end).indices(size)
        if lo >= hi:
            return b"", etag
        headers = {}
        if pinned or (lo, hi) != (0, size):
            headers["Range"] = f"bytes={lo}-{hi - 1}"
            if etag:
                headers["If-Range"] = etag
        try:
            with self.stream(rec["id"], path, headers) as resp:
                if "Range" in headers and resp.status_code != 206:
                    raise _stale(path)  # If-Range did not match: the whole new file follows
                total = resp.headers.get("content-range", "").rpartition("/")[2]
                if pinned and total != str(size):
                    raise _stale(path)
                return resp.read(), resp.headers.get("etag")
        except RangeNotSatisfiable:
            if pinned:
                raise _stale(path) from None  # it shrank below the range
            return b"", etag  # it shrank since it was looked up: nothing is there now

    def upload(
        self,
        path: str,
        content: bytes | Iterable[bytes],
        size: int | None,
        *,
        overwrite: bool,
        tier: str | None,
    ) -> Record:
        """One streamed ``PUT /v1/files/content``; returns the new record."""
        params: dict[str, Any] = {"path": path, "overwrite": "true" if overwrite else "false"}
        if tier:
            params["tier"] = tier
        headers = {"Content-Type": "application/octet-stream"}
        if size is not None:
            headers["Content-Length"] = str(size)
        resp = self.request(
            "PUT", "/v1/files/content", path, params=params, content=content, headers=headers
        )
        rec: Record = resp.json()
        self._record(path, rec)
        return rec

    def delete(self, rec: Record, path: str) -> None:
        """Remove a file (the admin token's call)."""
        self.request("DELETE", f"/v1/files/{rec['id']}", path, admin=True)
        self._record(path, None)
