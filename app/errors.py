"""The one place where engine errors become HTTP responses.

Every error body has one shape:
``{"error": {"code": "snake_case", "message": "...", "request_id": "...", ...}}``, and every error
response carries the request id in ``X-Request-ID`` too (see ``app.logs``).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from app.api.allow import allow_headers
from app.logs import REQUEST_ID_HEADER, current_request_id, request_id_var
from tiering import errors as e

__all__ = [
    "CLIENT_CLOSED",
    "HttpError",
    "error_response",
    "install_error_handlers",
    "status_for",
]

log = logging.getLogger(__name__)

# Most specific first: the first class an error is an instance of decides its status.
_STATUS: list[tuple[type[e.TierdError], int]] = [
    (e.InvalidRange, 416),
    (e.ChecksumMismatch, 400),
    (e.InvalidInput, 422),
    (e.NotFound, 404),
    (e.PreconditionFailed, 412),
    (e.Conflict, 409),
    (e.TooLarge, 413),
    (e.InsufficientSpace, 507),
    (e.Unavailable, 503),
    (e.IntegrityError, 500),
    (e.BackendUnavailable, 503),
    (e.ClosedFile, 409),
]

#: The status counted for a request whose client went away before it was read (nginx's "client
#: closed request"): a client error in ``/metrics``, told apart from bad input. Nobody receives
#: it, so no route declares it.
CLIENT_CLOSED = 499


class HttpError(Exception):
    """An error the HTTP layer itself raises (auth, request shape), with its status."""

    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers


def status_for(exc: e.TierdError) -> int:
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def error_response(
    status: int,
    code: str,
    message: str,
    headers: Mapping[str, str] | None = None,
    **details: object,
) -> JSONResponse:
    """The error response; ``request_id`` defaults to the current request's (``app.logs``)."""
    body: dict[str, object] = {"code": code, "message": message}
    body.update({k: v for k, v in details.items() if v is not None})
    rid = body.get("request_id") or current_request_id()
    if rid is not None:
        body["request_id"] = rid
        headers = {**(headers or {}), REQUEST_ID_HEADER: str(rid)}
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def _request_id(req: Request) -> str | None:
    rid = getattr(req.state, "request_id", None)
    return rid if isinstance(rid, str) else current_request_id()


def _jsonable(details: dict[str, object]) -> dict[str, object]:
    return {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in details.items()}


def _tier_roots(req: Request) -> list[str]:
    engine = getattr(req.app.state, "engine", None)
    if engine is None:
        return []
    # A directory tier's location is its root; an object tier's never appears in a path.
    return [f"{tier.location}/" for tier in engine.tiers]


def _relative(text: str, roots: list[str]) -> str:
    """``text`` with each tier root's absolute prefix cut, so a path reads as its relpath."""
    for root in roots:
        text = text.replace(root, "")
    return text


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(e.TierdError)
    async def _tierd(req: Request, exc: e.TierdError) -> JSONResponse:
        status = status_for(exc)
        if status >= 500:
            log.error("%s: %s", type(exc).__name__, exc.message)
        headers = None
        if isinstance(exc, e.InvalidRange) and "size" in exc.details:
            headers = {"Content-Range": f"bytes */{exc.details['size']}"}
        # Clients name files by relpath: the server's own paths (a tier's root) stay in its log.
        hide = _tier_roots(req)
        details = {
            k: _relative(v, hide) if isinstance(v, str) else v
            for k, v in _jsonable(exc.details).items()
        }
        return error_response(status, exc.code, _relative(exc.message, hide), headers, **details)

    @app.exception_handler(HttpError)
    async def _http(_req: Request, exc: HttpError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return error_response(422, "invalid_request", "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(req: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, str(exc.detail), allow_headers(req, exc))

    @app.exception_handler(ClientDisconnect)
    async def _gone(req: Request, _exc: ClientDisconnect) -> JSONResponse:
        # The client closed the connection mid-body (an aborted upload): the route's cleanup
        # already ran as the error passed through it. Not a server fault: one line, no trace.
        log.warning(
            "client disconnected before its %s %s was read; nothing was kept",
            req.method,
            req.url.path,
        )
        return error_response(CLIENT_CLOSED, "client_disconnected", "the client disconnected")

    @app.exception_handler(OSError)
    async def _os(_req: Request, exc: OSError) -> JSONResponse:
        # Storage faults the engine did not translate: say what failed, never a stack trace.
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return error_response(507, "insufficient_space", f"no space: {exc.strerror}")
        log.error("storage error: %s", exc)
        return error_response(500, "io_error", f"storage error: {exc.strerror or exc}")

    @app.exception_handler(Exception)
    async def _unexpected(req: Request, exc: Exception) -> JSONResponse:
        # Starlette runs this outside the middleware stack: take the id from the request.
        rid = _request_id(req)
        token = request_id_var.set(rid)
        try:
            log.exception("unhandled error")
        finally:
            request_id_var.reset(token)
        return error_response(
            500, "internal_error", f"internal error: {type(exc).__name__}", request_id=rid
        )
