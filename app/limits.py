"""Load shedding: past ``max_inflight_requests`` at once, answer 429 instead of queueing.

A flood then costs the server a small JSON reply per excess request, and the requests already
admitted keep their memory and threads. Health probes are always admitted. The 429 is an error
like any other (``app.errors.error_response``): its body carries the request's id, which
:class:`app.logs.RequestId`, the outer middleware, has already set.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import error_response

__all__ = ["InflightLimit"]

_EXEMPT = ("/healthz", "/readyz", "/metrics")


class InflightLimit:
    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.inflight = 0  # only touched on the event loop thread

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _EXEMPT:
            await self.app(scope, receive, send)
            return
        if self.inflight >= self.limit:
            response = error_response(
                429,
                "too_many_requests",
                f"more than {self.limit} requests in flight; retry shortly",
                {"Retry-After": "1"},
            )
            await response(scope, receive, send)
            return
        self.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1
