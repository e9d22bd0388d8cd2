"""``Allow`` on a 405: every method the path takes, not only those of the first route matched;
and ``HEAD`` answered wherever ``GET`` is.

FastAPI makes one route per method, and Starlette's 405 names only the methods of the first
route whose path matched. The error handler for Starlette's HTTPException calls
:func:`allow_headers` to put the full list in the ``Allow`` header.

FastAPI's GET routes do not take HEAD (Starlette's own routes do), though HTTP asks every GET
resource to, and load balancers probe ``/readyz`` with it. :class:`HeadAsGet` runs a HEAD as
the GET it asks about; the server (uvicorn) sends the headers and drops the body.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["HeadAsGet", "allow_headers", "allowed_methods"]


def _routes(routes: Iterable[Any]) -> Iterator[Any]:
    # FastAPI >= 0.16x keeps included routers as nested branches: walk them.
    for route in routes:
        nested = getattr(route, "effective_candidates", None)
        if callable(nested):
            yield from _routes(nested())
        else:
            yield route


def allowed_methods(request: Request) -> list[str]:
    """The methods of every route of the app whose path matches this request's, sorted."""
    path = request.scope.get("path", "")
    methods: set[str] = set()
    for route in _routes(getattr(request.app, "routes", ())):
        route_methods = getattr(route, "methods", None)
        route_path = getattr(route, "path", None)
        if not route_methods or not isinstance(route_path, str):
            continue
        regex, _, _ = compile_path(route_path)
        if regex.match(path):
            methods.update(route_methods)
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


def allow_headers(request: Request, exc: HTTPException) -> Mapping[str, str] | None:
    """``exc``'s headers, with ``Allow`` listing every method of the path when it is a 405."""
    if exc.status_code != 405:
        return exc.headers
    methods = allowed_methods(request)
    if not methods:
        return exc.headers
    return {**(exc.headers or {}), "Allow": ", ".join(methods)}


#: The scope key that marks a GET run for a HEAD: a route whose GET counts an access of a
#: file (its content) counts none for a HEAD, which reads nothing.
HEAD = "tierd.head"


def is_head(scope: Scope) -> bool:
    """Whether this GET answers a HEAD (see :class:`HeadAsGet`)."""
    return bool(scope.get(HEAD))


class HeadAsGet:
    """ASGI middleware: a HEAD request runs as a GET; the outer scope keeps ``HEAD``, so the
    server sends no body and the metrics count a HEAD."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        inner = {**scope, "method": "GET", HEAD: True}
        try:
            await self.app(inner, receive, send)
        finally:
            if "route" in inner:  # for the metrics' route template
                scope["route"] = inner["route"]
