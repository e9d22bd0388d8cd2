"""A fault-injecting HTTP proxy for the S3-protocol test server.

It sits on loopback in front of moto and forwards every request, except those a :class:`Rule`
picks. Those it answers with an S3 error (``503 SlowDown``, ``500``, ``403``...: see
:data:`ERRORS`), drops (``reset``: the connection closes with a reset and no response),
forwards and then drops (``drop_response``: the server did the work, the client never hears
of it), or truncates (``truncate``: the response's headers and half its body, then a reset).
So the object tier's retries are tested against real bytes on real sockets, request by
request. It also keeps the origin's own account of what it sent (:attr:`FaultProxy.sent`: body
bytes by request path), so a test counts the bucket's bytes from the bucket's side, not from
tierd's counters.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import struct
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

__all__ = ["FaultProxy", "Rule"]

#: Actions that answer with an S3 error instead of forwarding: (status, S3 error code).
ERRORS = {
    "503": (503, "ServiceUnavailable"),
    "slowdown": (503, "SlowDown"),
    "500": (500, "InternalError"),
    "412": (412, "PreconditionFailed"),
    "403": (403, "AccessDenied"),
}
Headers = list[tuple[str, str]]
Edit = Callable[[int, Headers, bytes], tuple[int, Headers, bytes]]
_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection"}


@dataclass
class Rule:
    """Fail the ``nth`` to ``nth + times - 1``-th requests that match.

    ``method``: HTTP method; ``query``: a substring of the query string (``"partNumber="``,
    ``"uploads"``); ``header``: a header the request must carry (``"Range"``).
    ``action``: a key of :data:`ERRORS`, ``"reset"``, ``"drop_response"``, ``"truncate"``, or
    ``"edit"``: forward, then pass (status, headers, body) through ``edit`` (a store that
    answers wrongly).
    """

    action: str
    method: str | None = None
    query: str | None = None
    header: str | None = None
    nth: int = 1
    times: int = 1
    edit: Edit | None = None
    seen: int = 0
    fired: int = 0

    def matches(self, method: str, query: str, headers: dict[str, str]) -> bool:
        return (
            (self.method is None or method == self.method)
            and (self.query is None or self.query in query)
            and (self.header is None or self.header.lower() in headers)
        )


@dataclass
class _State:
    upstream: tuple[str, int]
    rules: list[Rule] = field(default_factory=list)
    log: list[tuple[str, str, str]] = field(default_factory=list)
    sent: dict[str, int] = field(default_factory=dict)  # body bytes sent, by path
    lock: threading.Lock = field(default_factory=threading.Lock)
    conns: set[socket.socket] = field(default_factory=set)

    def decide(self, method: str, path: str, headers: dict[str, str]) -> tuple[str, Rule | None]:
        query = urllib.parse.urlsplit(path).query
        with self.lock:
            action, chosen = "forward", None
            for rule in self.rules:
                if rule.matches(method, query, headers):
                    rule.seen += 1
                    if chosen is None and rule.nth <= rule.seen < rule.nth + rule.times:
                        rule.fired += 1
                        action, chosen = rule.action, rule
            self.log.append((method, path, action))
            return action, chosen


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a crashed peer or a middlebox would."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    _up: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        pass

    def setup(self) -> None:
        super().setup()
        with self.server.state.lock:
            self.server.state.conns.add(self.connection)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        with self.server.state.lock:
            self.server.state.conns.discard(self.connection)
        if self._up is not None:
            self._up.close()

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        action, rule = self.server.state.decide(self.command, self.path, headers)
        if action == "reset":
            self.close_connection = True
            _reset(self.connection)
            return
        if action in ERRORS:
            status, code = ERRORS[action]
            xml = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>injected by the test proxy</Message></Error>"
            ).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(xml)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(xml)
            return
        status, reason, out_headers, data = self._forward(body)
        if action == "edit" and rule is not None and rule.edit is not None:
            status, out_headers, data = rule.edit(status, out_headers, data)
        if action == "drop_response":
            self.close_connection = True
            _reset(self.connection)
            return
        self.send_response(status, reason)
        for k, v in out_headers:
            if k.lower() in _HOP or (k.lower() == "content-length" and self.command != "HEAD"):
                continue
            self.send_header(k, v)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if action == "truncate" and len(data) > 1:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            _reset(self.connection)
            return
        self.wfile.write(data)
        if self.command == "GET":
            key = urllib.parse.urlsplit(self.path).path
            with self.server.state.lock:
                self.server.state.sent[key] = self.server.state.sent.get(key, 0) + len(data)

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        for attempt in (1, 2):
            if self._up is None:
                self._up = http.client.HTTPConnection(*self.server.state.upstream, timeout=60)
            try:
                self._up.putrequest(
                    self.command, self.path, skip_host=True, skip_accept_encoding=True
                )
                for k, v in self.headers.items():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        self._up.putheader(k, v)
                self._up.putheader("Content-Length", str(len(body)))
                self._up.endheaders(body)
                resp = self._up.getresponse()
                data = resp.read()
                return resp.status, resp.reason, resp.getheaders(), data
            except (OSError, http.client.HTTPException):
                self._up.close()
                self._up = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve


class _Server(ThreadingHTTPServer):
    # Handler threads are joined by server_close(), so a test leaks none.
    daemon_threads = False
    block_on_close = True

    def __init__(self, state: _State) -> None:
        self.state = state
        super().__init__(("127.0.0.1", 0), _Handler)


class FaultProxy:
    """``with FaultProxy(moto_url) as proxy:`` then point a tier's endpoint at ``proxy.url``
    and add rules with :meth:`fail`."""

    def __init__(self, upstream_url: str) -> None:
        up = urllib.parse.urlsplit(upstream_url)
        assert up.hostname and up.port
        self.state = _State((up.hostname, up.port))
        self._server = _Server(self.state)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="s3-proxy"
        )

    def fail(self, action: str, **match: object) -> Rule:
        rule = Rule(action, **match)  # type: ignore[arg-type]
        with self.state.lock:
            self.state.rules.append(rule)
        return rule

    @property
    def sent(self) -> dict[str, int]:
        """Body bytes of GETs answered in full, by request path (``/bucket/key``)."""
        with self.state.lock:
            return dict(self.state.sent)

    @property
    def log(self) -> list[tuple[str, str, str]]:
        with self.state.lock:
            return list(self.state.log)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        # Wake handlers idling on keep-alive connections, then join them.
        with self.state.lock:
            conns = list(self.state.conns)
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
