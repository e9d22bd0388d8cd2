"""Load shedding: past ``max_inflight_requests`` at once, answer 429 instead of queueing.

A flood then costs the server a small JSON reply per excess request, and the requests already
admitted keep their memory and threads. Health probes are always admitted.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

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
            body = json.dumps(
                {
                    "error": {
                        "code": "too_many_requests",
                        "message": f"more than {self.limit} requests in flight; retry shortly",
                    }
                }
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 429,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"retry-after", b"1"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        self.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1
