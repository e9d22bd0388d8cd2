"""A streamed body that finds damage after its status line went out: the connection is cut,
with one warning line, never a traceback.

A full read sends each chunk only after it passed its digest check, so a damaged chunk stops
the body before any of its bytes go out; but the status line (200) and the chunks before it
are gone by then. HTTP has no way to take a 200 back: the connection is closed without
finishing the body, and every client sees an error (curl 18, httpx ``RemoteProtocolError``,
fsspec a failed read), never a short file taken for a whole one. The engine has quarantined
the file already (:mod:`tiering.integrity`) and logged the one warning line.

ASGI has no "abort" message, so :func:`guard_body` turns the error into :class:`StreamAborted`,
which no exception handler knows (Starlette's would log "response already started" with a
traceback), and :class:`AbortedStreams`, outermost, ends the request there. uvicorn then
closes the connection, logging "ASGI callable returned without completing response", which
:class:`QuietAborts` drops for these requests only (the context variable is set in the
request's own task, where uvicorn logs it).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterable, Iterator

from starlette.types import ASGIApp, Receive, Scope, Send

from tiering.errors import IntegrityError

__all__ = ["AbortedStreams", "QuietAborts", "StreamAborted", "guard_body"]

_aborted: contextvars.ContextVar[bool] = contextvars.ContextVar("tierd_aborted", default=False)


class StreamAborted(Exception):
    """A body stopped by damage after its response started (see the module)."""


def guard_body(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """``chunks``, with damage found on the way raised as :class:`StreamAborted`."""
    try:
        yield from chunks
    except IntegrityError as exc:
        raise StreamAborted(exc.message) from None


class AbortedStreams:
    """Pure ASGI middleware, outermost: a :class:`StreamAborted` ends the request, unfinished,
    so the server closes the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except StreamAborted:
            _aborted.set(True)


class QuietAborts(logging.Filter):
    """Drops the server's "returned without completing response" line for a request that
    :class:`AbortedStreams` ended on purpose (the engine logged why)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_aborted.get() and "without completing response" in record.getMessage())

    @classmethod
    def install(cls) -> None:
        server = logging.getLogger("uvicorn.error")
        if not any(isinstance(f, cls) for f in server.filters):
            server.addFilter(cls())
