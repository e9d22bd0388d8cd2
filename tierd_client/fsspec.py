"""tierd as an fsspec filesystem: ``tierd://models/x/config.json``, over the REST API.

Needs the optional extra (``pip install 'tierd[fsspec]'``); the rest of :mod:`tierd_client`
never imports fsspec. The package registers the ``tierd`` protocol through fsspec's
``fsspec.specs`` entry point, so once installed::

    import fsspec
    fs = fsspec.filesystem("tierd", url="http://127.0.0.1:8470", token=data_token)
    fs.ls("models/llama")                       # files and directories, with tier and heat
    with fsspec.open("tierd://models/llama/config.json", "rt", url=..., token=...) as f:
        config = json.load(f)

``url``, ``token`` and ``admin_token`` default to ``TIERD_URL`` (else
``http://127.0.0.1:8470``), ``TIERD_DATA_TOKEN`` (else ``TIERD_ADMIN_TOKEN``) and
``TIERD_ADMIN_TOKEN`` (else ``token``), read when the filesystem is made.

What maps to what:

- **Paths** are tierd relpaths: ``tierd://a/b``, ``/a/b`` and ``a/b`` all name ``a/b``; the root
  is ``""``.
- **Directories are implied** by the files under them (tierd catalogs files, not directories):
  ``ls`` derives them from one prefix listing, a directory exists exactly while a file is below
  it, and ``mkdir``/``makedirs`` succeed without doing anything. An empty directory cannot exist
  (though on a directory tier tierd leaves emptied directories in the tier root, so a name once
  used as a directory stays unusable for a file there: ``FileExistsError``).
- **Reads** look the file up by path, then read its bytes by id. ``cat_file`` (ranges
  included) and ``get_file`` are one request each; an open file reads one ``Range`` request per
  block (fsspec's ``readahead`` cache, 16 MiB blocks by default). Every block must come from the
  version opened: its ``Content-Range`` must give the size seen at open, and later blocks send
  ``If-Range`` with the first reply's ETag (tierd's checksum), so a file replaced while open
  raises ``OSError(ESTALE)`` instead of mixing versions. Every content request counts as one
  access toward the file's heat, so a file read block by block heats up by its block count.
- **Writes** (``pipe_file``, ``put_file``, ``open(mode="wb"|"xb")``) are one streamed
  ``PUT /v1/files/content`` each; an open file spools to a temporary file (memory first) and
  uploads on close. ``mode="create"``/``"xb"`` upload with ``overwrite=false``, so creation is
  atomic on the server. Appending (``"ab"``) is not supported: tierd writes files whole.
- ``cp_file`` streams the source's bytes into an upload of the destination (tierd has no
  server-side copy). ``rm`` needs the admin token (``PermissionError`` without it).
- ``ukey``/``checksum`` come from tierd's content checksum and the record's generation.
- **Bulk operations** (``copy``, ``rm``, ``get``, ``put``, ``cat``, ``cat_ranges``,
  ``expand_path``, ``glob``) list each prefix once and look each path up once
  (``tierd_client._fsremote``); nothing is cached between calls, so another client's changes
  are seen by the next call. ``ls`` lists everything below its path (tierd's listing has no
  delimiter), a page of 1000 records per request.
- **Processes**: the filesystem pickles (dask ships it; the copy connects on its own), and one
  handed to a forked worker (a DataLoader's, say) opens its own connections there.
- **Errors**: no such file, or a lookup of a path tierd could never hold →
  ``FileNotFoundError``; a write to such a path (``a//b``, ``..``, a file as a parent) →
  ``OSError(EINVAL)`` with the server's reason; 401/403 → ``PermissionError``; an existing file
  on a create, or a directory where a file is written → ``FileExistsError``; 507 →
  ``OSError(ENOSPC)``; other replies
  raise the client's :class:`~tierd_client.APIError` subclasses (``tier_not_found``,
  ``file_busy`` while a file is migrated...), and an unreachable server a ``ConnectionError``.

Kept whole past 450 lines: one fsspec filesystem and its file object, whose methods fsspec's
interface fixes.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import IO, Any, TypeVar

import httpx

try:
    from fsspec.callbacks import DEFAULT_CALLBACK, Callback
    from fsspec.spec import AbstractBufferedFile, AbstractFileSystem
    from fsspec.utils import isfilelike
except ImportError as exc:  # an optional extra: say how to get it
    raise ImportError("tierd_client.fsspec needs fsspec: pip install 'tierd[fsspec]'") from exc

from ._fsremote import Record, Remote

__all__ = ["TierdFile", "TierdFileSystem"]

DEFAULT_URL = "http://127.0.0.1:8470"
CHUNK = 1 << 20  # bytes per piece of a streamed upload or download
SPOOL = 8 << 20  # a file open for writing stays in memory up to this size

F = TypeVar("F", bound=Callable[..., Any])


def _entry(rec: Mapping[str, Any]) -> dict[str, Any]:
    """An fsspec file entry: name, size, type, and tierd's fields (id, tier, heat, checksum...)."""
    out = {k: v for k, v in rec.items() if k != "path"}
    out.update(name=rec["path"], size=rec["size"], type="file")
    return out


def _dir(name: str) -> dict[str, Any]:
    return {"name": name, "size": 0, "type": "directory"}


def _one_listing(method: F) -> F:
    """Run a bulk operation from one listing per prefix (``Remote.snapshot``)."""

    @functools.wraps(method)
    def wrapper(self: TierdFileSystem, *args: Any, **kwargs: Any) -> Any:
        with self.remote.snapshot():
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _pieces(f: IO[bytes], callback: Callback = DEFAULT_CALLBACK) -> Iterator[bytes]:
    while piece := f.read(CHUNK):
        callback.relative_update(len(piece))
        yield piece


def _ancestors(paths: list[str]) -> set[str]:
    """Every directory that holds one of ``paths``."""
    out: set[str] = set()
    for p in paths:
        while (p := p.rpartition("/")[0]) and p not in out:
            out.add(p)
    return out


class TierdFileSystem(AbstractFileSystem):  # type: ignore[misc]  # fsspec is untyped
    """tierd's files through fsspec (see the module's docstring for the semantics).

    Parameters
    ----------
    url:
        Where tierd listens; default ``TIERD_URL``, else ``http://127.0.0.1:8470``.
    token:
        The token for reads and writes; default ``TIERD_DATA_TOKEN``, else ``TIERD_ADMIN_TOKEN``.
    admin_token:
        The token for deletes; default ``TIERD_ADMIN_TOKEN``, else ``token``.
    timeout:
        Seconds per request.
    tier:
        Tier uploads go to (default: the file's current tier, else the server's default).
    transport:
        An httpx transport, e.g. ``httpx.HTTPTransport(retries=3)`` or one on a Unix socket.
    """

    protocol = "tierd"
    root_marker = ""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        admin_token: str | None = None,
        *,
        timeout: float = 120.0,
        tier: str | None = None,
        transport: httpx.BaseTransport | None = None,
        **storage_options: Any,
    ) -> None:
        super().__init__(**storage_options)
        env = os.environ
        self.url = (url or env.get("TIERD_URL") or DEFAULT_URL).rstrip("/")
        token = token or env.get("TIERD_DATA_TOKEN") or env.get("TIERD_ADMIN_TOKEN")
        admin_token = admin_token or env.get("TIERD_ADMIN_TOKEN") or token
        self.tier = tier
        self.remote = Remote(self.url, token, admin_token, timeout=timeout, transport=transport)
        weakref.finalize(self, self.remote.close)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list | tuple):
            return [cls._strip_protocol(p) for p in path]
        path = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
        if path.startswith("tierd://"):
            path = path[len("tierd://") :]
        return path.strip("/")

    # -- listing ---------------------------------------------------------------------------
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        prefix = f"{path}/" if path else ""
        entries: dict[str, dict[str, Any]] = {}
        for rec in self.remote.records(prefix):
            head, sep, _ = rec["path"][len(prefix) :].partition("/")
            name = prefix + head
            if sep:
                entries.setdefault(name, _dir(name))
            else:
                entries[name] = _entry(rec)
        if not entries and path:
            entries[path] = _entry(self.remote.lookup(path))  # a file lists itself
        out = [entries[k] for k in sorted(entries)]
        return out if detail else [e["name"] for e in out]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        if not path:
            return _dir("")
        rec = self.remote.lookup_or_none(path)
        if rec is not None:
            return _entry(rec)
        if any(True for _ in self.remote.records(f"{path}/", limit=1)):
            return _dir(path)
        raise FileNotFoundError(errno.ENOENT, "no such file or directory", path)

    def find(
        self,
        path: str,
        maxdepth: int | None = None,
        withdirs: bool = False,
        detail: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Everything below ``path``, from one prefix listing (not an ``ls`` per level)."""
        if maxdepth is not None and maxdepth < 1:
            raise ValueError("maxdepth must be at least 1")
        path = self._strip_protocol(path)
        prefix = f"{path}/" if path else ""
        out: dict[str, dict[str, Any]] = {}
        for rec in self.remote.records(prefix):
            parts = rec["path"][len(prefix) :].split("/")
            if withdirs:
                for level in range(1, min(len(parts), (maxdepth or len(parts)) + 1)):
                    name = prefix + "/".join(parts[:level])
                    out.setdefault(name, _dir(name))
            if maxdepth is None or len(parts) <= maxdepth:
                out[rec["path"]] = _entry(rec)
        if out and withdirs and path:
            out[path] = _dir(path)
        if not out and path and (rec_ := self.remote.lookup_or_none(path)) is not None:
            out[path] = _entry(rec_)
        names = sorted(out)
        return {n: out[n] for n in names} if detail else names

    expand_path = _one_listing(AbstractFileSystem.expand_path)
    glob = _one_listing(AbstractFileSystem.glob)
    copy = _one_listing(AbstractFileSystem.copy)
    get = _one_listing(AbstractFileSystem.get)
    put = _one_listing(AbstractFileSystem.put)
    cat = _one_listing(AbstractFileSystem.cat)
    cat_ranges = _one_listing(AbstractFileSystem.cat_ranges)

    def ukey(self, path: str) -> str:
        """Changes whenever the file's bytes or record do: tierd's checksum and generation."""
        info = self._file_info(path)
        key = f"{info['id']}:{info['generation']}:{info['checksum']}:{info['size']}"
        return hashlib.sha256(key.encode()).hexdigest()

    def checksum(self, path: str) -> int:
        return int(self.ukey(path)[:32], 16)

    def modified(self, path: str) -> datetime:
        return datetime.fromtimestamp(self._file_info(path)["mtime_ns"] / 1e9, UTC)

    def created(self, path: str) -> datetime:
        return datetime.fromisoformat(self._file_info(path)["created_at"])

    def _file_info(self, path: str) -> dict[str, Any]:
        info = self.info(path)
        if info["type"] != "file":
            raise IsADirectoryError(errno.EISDIR, "directories are implied by files", path)
        return info

    # -- directories: implied --------------------------------------------------------------
    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        """Nothing to do: a directory exists while a file is below it."""

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Nothing to do: a directory exists while a file is below it."""

    def rmdir(self, path: str) -> None:
        """Nothing to do: a directory goes with its last file."""

    # -- reads -----------------------------------------------------------------------------
    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        """Bytes ``[start, end)`` (negative: from the end) in one request after the lookup."""
        path = self._strip_protocol(path)
        return self.remote.read(self.remote.lookup(path), path, start, end)[0]

    def get_file(
        self,
        rpath: str,
        lpath: Any,
        callback: Callback = DEFAULT_CALLBACK,
        outfile: IO[bytes] | None = None,
        **kwargs: Any,
    ) -> None:
        """Download a file in one streamed request (a directory: make it locally)."""
        rpath = self._strip_protocol(rpath)
        if outfile is None and isfilelike(lpath):
            outfile = lpath
        rec = self.remote.lookup_or_none(rpath)
        if rec is None:
            if outfile is None and self.isdir(rpath):
                os.makedirs(lpath, exist_ok=True)
                return
            raise FileNotFoundError(errno.ENOENT, "no such file", rpath)
        callback.set_size(rec["size"])
        with self.remote.stream(rec["id"], rpath) as resp:
            if outfile is not None:
                self._drain(resp, outfile, callback)
                return
            os.makedirs(os.path.dirname(os.path.abspath(lpath)), exist_ok=True)
            with open(lpath, "wb") as f:
                self._drain(resp, f, callback)

    @staticmethod
    def _drain(resp: httpx.Response, out: IO[bytes], callback: Callback) -> None:
        for piece in resp.iter_bytes(CHUNK):
            out.write(piece)
            callback.relative_update(len(piece))

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TierdFile:
        path = self._strip_protocol(path)
        return TierdFile(
            self, path, mode, block_size, autocommit, cache_options=cache_options, **kwargs
        )

    # -- writes ----------------------------------------------------------------------------
    def pipe_file(
        self, path: str, value: bytes, mode: str = "overwrite", tier: str | None = None, **kw: Any
    ) -> None:
        data = bytes(value)
        self.remote.upload(
            self._strip_protocol(path),
            data,
            len(data),
            overwrite=mode != "create",
            tier=tier or self.tier,
        )

    def put_file(
        self,
        lpath: str,
        rpath: str,
        callback: Callback = DEFAULT_CALLBACK,
        mode: str = "overwrite",
        tier: str | None = None,
        **kwargs: Any,
    ) -> None:
        """Upload a local file in one streamed request (a local directory: nothing to do)."""
        if os.path.isdir(lpath):
            return
        with open(lpath, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            callback.set_size(size)
            self.remote.upload(
                self._strip_protocol(rpath),
                _pieces(f, callback),
                size,
                overwrite=mode != "create",
                tier=tier or self.tier,
            )

    def cp_file(self, path1: str, path2: str, tier: str | None = None, **kwargs: Any) -> None:
        """Stream the source's bytes into an upload (a directory: nothing to do)."""
        path1, path2 = self._strip_protocol(path1), self._strip_protocol(path2)
        rec = self.remote.lookup_or_none(path1)
        if rec is None:
            if self.isdir(path1):
                return
            raise FileNotFoundError(errno.ENOENT, "no such file", path1)
        with self.remote.stream(rec["id"], path1) as resp:
            pieces = resp.iter_bytes(CHUNK)
            self.remote.upload(path2, pieces, rec["size"], overwrite=True, tier=tier or self.tier)

    # -- deletes (admin) --------------------------------------------------------------------
    def rm_file(self, path: str) -> None:
        path = self._strip_protocol(path)
        self.remote.delete(self.remote.lookup(path), path)

    @_one_listing
    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        """Delete files; with ``recursive``, every file below directories too (a directory goes
        with its last file). Every path is checked before the first delete: a directory without
        ``recursive`` (``IsADirectoryError``) or a missing path deletes nothing."""
        paths = self.expand_path(path, recursive=recursive, maxdepth=maxdepth)
        dirs = _ancestors(paths)
        files: list[tuple[str, Record]] = []
        for p in paths:
            if p in dirs:
                continue  # its files are in the list
            rec = self.remote.lookup_or_none(p)
            if rec is not None:
                files.append((p, rec))
            elif self.isdir(p):
                raise IsADirectoryError(errno.EISDIR, "a directory: pass recursive=True", p)
            else:
                raise FileNotFoundError(errno.ENOENT, "no such file or directory", p)
        for p, rec in reversed(files):
            self.remote.delete(rec, p)


class TierdFile(AbstractBufferedFile):  # type: ignore[misc]  # fsspec is untyped
    """A tierd file opened through fsspec: ranged reads of the version opened, by id; or one
    upload on close (``commit``)."""

    # Each block is one request and one access; tierd's files are mostly large (model shards),
    # where fsspec's 5 MiB would spend about a third of the time in round trips on loopback.
    DEFAULT_BLOCK_SIZE = 16 << 20

    fs: TierdFileSystem

    def __init__(self, fs: TierdFileSystem, path: str, mode: str = "rb", *a: Any, **kw: Any):
        self._tier: str | None = kw.pop("tier", None) or fs.tier
        if mode == "ab":
            raise NotImplementedError("tierd writes files whole: append is not supported")
        if mode == "rb" and "size" not in kw:
            info = fs.info(path)
            if info["type"] != "file":
                raise IsADirectoryError(errno.EISDIR, "is a directory", path)
            kw["size"] = info["size"]
            self._details = info
        if mode == "xb" and fs.remote.lookup_or_none(path) is not None:
            raise FileExistsError(errno.EEXIST, "the file exists", path)
        self._etag: str | None = None
        self._spool: IO[bytes] | None = None
        super().__init__(fs, path, mode, *a, **kw)

    def _fetch_range(self, start: int, end: int) -> bytes:
        if self._details is None or "id" not in self._details:
            self._details = self.fs.info(self.path)
        rec: Record = {"id": self._details["id"], "size": self.size}
        data, etag = self.fs.remote.read(rec, self.path, start, end, pinned=True, etag=self._etag)
        self._etag = self._etag or etag
        return data

    def _initiate_upload(self) -> None:
        # closed by commit or discard
        self._spool = tempfile.SpooledTemporaryFile(max_size=SPOOL)  # noqa: SIM115

    def _upload_chunk(self, final: bool = False) -> bool:
        assert self._spool is not None
        self._spool.write(self.buffer.getbuffer())
        if final and self.autocommit:
            self.commit()
        return True

    def commit(self) -> None:
        """Upload what was written, in one streamed request."""
        if self._spool is None:  # nothing was flushed: an empty file
            self._initiate_upload()
        assert self._spool is not None
        spool, self._spool = self._spool, None
        with spool:
            size = spool.tell()
            spool.seek(0)
            overwrite = self.mode != "xb"
            self.fs.remote.upload(
                self.path, _pieces(spool), size, overwrite=overwrite, tier=self._tier
            )

    def discard(self) -> None:
        if self._spool is not None:
            self._spool.close()
            self._spool = None
