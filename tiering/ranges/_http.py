"""tierd's own HTTP/1.1 connections to a reader's URL: ranged GETs whose bodies the kernel
copies straight into the destination.

**Why not only KvikIO.** KvikIO's ``RemoteFile`` (libcurl) receives each body into curl's
buffer, then copies it again: into the destination in host memory, or into a bounce buffer
and on to the GPU. Where the origin shares the host's cores (a cache beside the GPUs, a
loopback origin) that second copy is CPU the origin lacks. Measured on the H100 machine, 1 GiB
from nginx on loopback at 64 connections x 8 MiB: KvikIO into host memory 19.8 GB/s for 598 ms
of CPU a load; these GETs 24.4 GB/s for 350 ms. A body is received by ``recv`` with
``MSG_WAITALL``: one system call per body (or per staging piece), with the GIL released for
all of it, so Python threads cost nothing per byte.

- **Scope.** Plain ``http://`` URLs with no proxy for their host. TLS through Python's ``ssl``
  would read one 16 KiB record a call, and a proxy speaks differently: those URLs raise
  :class:`HttpUnsupported` at :meth:`HttpReads.open`, and the caller reads through KvikIO or
  the reader's own GETs.
- **Consistency.** Every GET carries the reader's :meth:`~tiering.ranges.RangeReader.pins`
  (``If-Match`` on the ETag opened), so no range mixes two versions; a reader that pins
  nothing is checked after the read (:attr:`HttpRanges.pinned`).
- **Failures.** A GET that fails for any reason (a reset, a kept-alive connection the server
  has closed, a timeout, a status other than 206) is sent once more on a new connection; a
  second failure raises :class:`HttpFailed` and :meth:`HttpRanges.get` reads the range through
  the inner reader instead: its retries, and its errors (a replaced object is a
  :class:`~tiering.errors.FileChanged` there).
- **Connections.** One per pool thread and origin, kept alive between GETs.
- **Fast and paced origins.** The first read of an origin that holds a GET of the task size
  sends that GET alone, into its place in the destination, and the rate of that one connection
  decides (:meth:`HttpReads.judge`; :meth:`HttpReads.known` after). At
  :data:`FAST_BPS` or more (a cache or store beside the host) GETs of twice the task size go
  out, half as many at once (:meth:`HttpReads.plan`): each GET costs the origin and the client
  fixed work (the request, the response head, a thread's turn at the GIL). Below it (S3 gives
  about 90 MB/s a connection) every connection is kept busy with GETs of the task size. A rate
  seen during a read cannot tell the two apart: with 128 GETs in flight each sees a 128th of a
  fast origin, as little as a paced connection gives.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, NamedTuple, Protocol

from tiering.ranges._reader import RangeReader, flat

__all__ = ["HttpFailed", "HttpMode", "HttpRanges", "HttpReads", "HttpUnsupported", "Sink"]

log = logging.getLogger(__name__)

HttpMode = Literal["auto", "never"]
"""``auto``: tierd's connections where the URL allows; ``never``."""
_MODES = ("auto", "never")

#: A response head longer than this is refused (S3's are under 1 KiB).
_HEAD_LIMIT = 64 << 10
#: An error body longer than this is not read: the connection is closed instead.
_DRAIN_LIMIT = 1 << 20
#: One connection alone at this rate or more: a fast origin (see the module). S3 gives about
#: 90 MB/s a connection; nginx on loopback several GB/s.
FAST_BPS = 1e9


class HttpUnsupported(Exception):
    """The URL is not one these connections read (https, a proxy, no host)."""


class HttpFailed(Exception):
    """A ranged GET failed twice (the reason is in the message)."""


class Sink(Protocol):
    """Where a body goes: :meth:`view` is the buffer for the body's bytes from ``pos`` (at
    most ``left`` of them, at least one), and :meth:`filled` says that it is full."""

    def view(self, pos: int, left: int) -> memoryview: ...

    def filled(self, pos: int, nbytes: int) -> None: ...


class _Into:
    """A sink that is one host buffer."""

    __slots__ = ("_view",)

    def __init__(self, view: memoryview) -> None:
        self._view = view

    def view(self, pos: int, left: int) -> memoryview:
        return self._view[pos : pos + left]

    def filled(self, pos: int, nbytes: int) -> None:
        pass


class _Response(Exception):
    """A status other than the one asked for (the body was read past, or the link closed)."""


class _Connection:
    """One kept-alive HTTP/1.1 connection to ``host:port``; a failure closes it."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._sock: socket.socket | None = None
        self._head = bytearray(_HEAD_LIMIT)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        # Blocking, with the kernel's own timeouts: a Python timeout makes the socket
        # non-blocking, and MSG_WAITALL would then return whatever had arrived.
        sock.settimeout(None)
        tv = struct.pack("ll", int(self.timeout_s), int(self.timeout_s % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        return sock

    def get(self, request: bytes, offset: int, nbytes: int, sink: Sink) -> None:
        """Send ``request`` (a GET of ``nbytes`` at ``offset``) and receive its body into
        ``sink``. Raises :class:`OSError` or :class:`_Response`; the connection is then
        closed."""
        try:
            self._get(request, offset, nbytes, sink)
        except BaseException:
            self.close()
            raise

    def _get(self, request: bytes, offset: int, nbytes: int, sink: Sink) -> None:
        sock = self._sock or self._connect()
        sock.sendall(request)
        status, headers, early = self._read_head(sock)
        length = int(headers.get("content-length", "-1"))
        if "transfer-encoding" in headers:
            raise _Response(f"a {status} with Transfer-Encoding {headers['transfer-encoding']}")
        if status != 206:
            self._drain(sock, length - len(early))
            raise _Response(f"HTTP {status}")
        first = headers.get("content-range", "").removeprefix("bytes ").partition("-")[0]
        if length != nbytes or first != str(offset) or len(early) > nbytes:
            raise _Response(f"206 of {length} bytes from {first or '?'} for {nbytes} from {offset}")
        pos = 0
        while pos < nbytes:
            view = sink.view(pos, nbytes - pos)
            want = len(view)
            got = min(len(early), want)  # the body's first bytes came with the head
            view[:got] = early[:got]
            early = early[got:]
            while got < want:
                k = sock.recv_into(view[got:], want - got, socket.MSG_WAITALL)
                if k == 0:
                    raise ConnectionError(f"closed after {pos + got} of {nbytes} bytes")
                got += k
            sink.filled(pos, want)
            pos += want
        if headers.get("connection", "").lower() == "close":
            self.close()

    def _read_head(self, sock: socket.socket) -> tuple[int, dict[str, str], memoryview]:
        """The status, the headers (names lower-cased) and the body's bytes that came with
        them (one ``recv`` usually holds the head and the body's first bytes)."""
        head, have = self._head, 0
        mv = memoryview(head)
        while True:
            k = sock.recv_into(mv[have:], len(head) - have)
            if k == 0:
                raise ConnectionError("closed before a response")
            end = head.find(b"\r\n\r\n", max(0, have - 3), have + k)
            have += k
            if end >= 0:
                break
            if have >= len(head):
                raise _Response("a response head over 64 KiB")
        lines = bytes(head[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise _Response(f"not an HTTP/1.x response: {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(parts[1]), headers, mv[end + 4 : have]

    def _drain(self, sock: socket.socket, length: int) -> None:
        """Read past the rest of an error's body so the connection can be used again; or
        close it."""
        if 0 <= length <= _DRAIN_LIMIT:
            scrap = bytearray(length)
            if length:
                sock.recv_into(scrap, length, socket.MSG_WAITALL)
        else:
            self.close()


class HttpReads:
    """Whether tierd's own connections read a reader's URL, their pool and settings.

    ``threads`` connections at most (one per pool thread); a read is split into GETs of
    ``task_size``, or of twice that on a fast origin (:meth:`plan`); a connection that neither
    sends nor receives for ``timeout_s`` fails; one connection alone at ``fast_bps`` or more is
    a fast origin's.
    """

    def __init__(
        self,
        mode: HttpMode,
        *,
        threads: int,
        task_size: int,
        expires_s: int,
        min_bytes: int = 0,
        timeout_s: float = 30.0,
        fast_bps: float = FAST_BPS,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"HTTP mode must be one of {', '.join(_MODES)}, not {mode!r}")
        self.mode = mode
        self.threads = threads
        self.task_size = task_size
        self.expires_s = expires_s
        self.min_bytes = min_bytes
        self.timeout_s = timeout_s
        self.fast_bps = fast_bps
        self._lock = threading.Lock()
        self._fast: dict[tuple[str, int], bool] = {}  # per origin, once its GET alone is in
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()

    def wins(self, reader: RangeReader | None, nbytes: int) -> bool:
        """Whether a read of ``nbytes`` from ``reader`` is tried on these connections (the
        URL may still be one they do not read: :meth:`open` says)."""
        if self.mode == "never" or nbytes < self.min_bytes:
            return False
        return reader is not None and reader.serves_url

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The pool whose threads own the connections (made at first need)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tierd-http")
            return self._pool

    def open(self, reader: RangeReader) -> HttpRanges:
        """``reader``'s bytes over these connections; :class:`HttpUnsupported` where its URL
        is not one they read."""
        ranges = HttpRanges(self, reader)
        ranges.target()  # the URL now: an unsupported one is refused at the open
        return ranges

    def known(self, ranges: HttpRanges) -> bool | None:
        """Whether ``ranges``' origin is a fast one; None until :meth:`judge` has said."""
        at = ranges.target()
        with self._lock:
            return self._fast.get((at.host, at.port))

    def judge(self, ranges: HttpRanges, nbytes: int, seconds: float) -> bool:
        """``ranges``' origin moved ``nbytes`` on one connection alone in ``seconds``: whether
        it is a fast one, kept for its later reads (the first judgement stands)."""
        at = ranges.target()
        fast = nbytes / max(seconds, 1e-9) >= self.fast_bps
        with self._lock:
            return self._fast.setdefault((at.host, at.port), fast)

    def plan(self, fast: bool) -> tuple[int, int]:
        """Bytes per GET and GETs in flight of a read: the task size on ``threads``
        connections, or on a fast origin GETs of twice that on half as many (the same bytes
        in flight). Measured on the H100 machine, 1 GiB from nginx on loopback into cuda in
        turns with KvikIO ``RemoteFile`` at 128 x 8 MiB: these connections at 64 x 16 MiB read
        1.08-1.15x, at 64 x 8 MiB 1.02x, at 128 x 8 MiB 0.96-1.08x; KvikIO at 16 MiB 0.95x."""
        if fast:
            return 2 * self.task_size, max(1, self.threads // 2)
        return self.task_size, self.threads

    def connection(self, host: str, port: int) -> _Connection:
        """The calling thread's connection to ``host:port``."""
        conns: dict[tuple[str, int], _Connection] = self._local.__dict__.setdefault("c", {})
        conn = conns.get((host, port))
        if conn is None:
            conn = conns[(host, port)] = _Connection(host, port, self.timeout_s)
        return conn

    def close(self) -> None:
        """Stop the pool; its threads' connections close with them."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class _Target(NamedTuple):
    host: str  # to connect to
    port: int
    authority: str  # the Host header: the URL's own, which a presigned URL's signature covers
    target: str  # path?query


def _target(url: str) -> _Target:
    """Where a plain-HTTP URL with no proxy for its host is read from."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise HttpUnsupported(f"not a plain http:// URL: {parts.scheme}://{parts.netloc}")
    if "http" in urllib.request.getproxies() and not urllib.request.proxy_bypass(parts.hostname):
        raise HttpUnsupported(f"{parts.hostname} is reached through a proxy")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    authority = parts.netloc.rpartition("@")[2]
    return _Target(parts.hostname, parts.port or 80, authority, target)


class HttpRanges(RangeReader):
    """``inner``'s bytes read over :class:`HttpReads`'s connections, by the URL ``inner``
    hands out (presigned again when half its lifetime has passed). :meth:`get` reads a range
    that failed twice through ``inner`` (see the module)."""

    serves_url = True

    def __init__(self, reads: HttpReads, inner: RangeReader) -> None:
        super().__init__(
            inner.name, inner.size, inner.version, pool=reads.pool, part_size=reads.task_size
        )
        self.inner = inner
        self.reads = reads
        self._pins = "".join(f"{k}: {v}\r\n" for k, v in inner.pins().items())
        self._lock = threading.Lock()
        self._at: _Target | None = None
        self._renew_at = 0.0

    @property
    def pinned(self) -> bool:
        """Every GET is pinned to the version opened; no check is needed after a read."""
        return bool(self._pins)

    def target(self) -> _Target:
        """Where the URL is read from, presigned again when due."""
        with self._lock:
            now = time.monotonic()
            if self._at is None or now >= self._renew_at:
                self._at = _target(self.inner.url(self.reads.expires_s))
                self._renew_at = now + self.reads.expires_s / 2
            return self._at

    def fetch(self, offset: int, nbytes: int, sink: Sink) -> None:
        """One ranged GET of ``nbytes`` at ``offset`` into ``sink`` on the calling thread's
        connection, sent again once on a new one; :class:`HttpFailed` after that."""
        at = self.target()
        request = (
            f"GET {at.target} HTTP/1.1\r\nHost: {at.authority}\r\n"
            f"Range: bytes={offset}-{offset + nbytes - 1}\r\n{self._pins}\r\n"
        ).encode("latin-1")
        conn = self.reads.connection(at.host, at.port)
        for attempt in (1, 2):
            try:
                conn.get(request, offset, nbytes, sink)
                break
            except (OSError, _Response) as exc:
                if attempt == 2:
                    raise HttpFailed(f"{self.name} at {offset}: {exc}") from exc
        self.inner.read_by_url(nbytes)

    def read(self, offset: int, nbytes: int, sink: Sink, *, fallback: Callable[[], None]) -> None:
        """:meth:`fetch`, and ``fallback()`` (which reads the range another way) when it
        failed."""
        try:
            self.fetch(offset, nbytes, sink)
        except HttpFailed as exc:
            log.info("%s; reading it through the tier's own GETs", exc)
            fallback()

    def get(self, view: memoryview, offset: int) -> None:
        view = flat(view)
        self.read(offset, len(view), _Into(view), fallback=lambda: self.inner.get(view, offset))

    def url(self, expires_s: int) -> str:
        return self.inner.url(expires_s)

    def pins(self) -> dict[str, str]:
        return self.inner.pins()

    def check_unchanged(self) -> None:
        self.inner.check_unchanged()
