"""The error statuses each operation declares in the OpenAPI schema, with the error body.

Every error answer has the shape ``app.errors.error_response`` writes:
``{"error": {"code": "...", "message": "...", "request_id": "...", ...details}}``. Use the
dicts here as ``responses=`` on a route, merged with ``|``::

    @router.get("/{file_id}", responses=NOT_FOUND | BUSY)
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "AUTH",
    "ADMIN",
    "AUTH_ADMIN",
    "BAD_REQUEST",
    "BUSY",
    "CONFLICT",
    "DATA",
    "INVALID",
    "JSON_BODY",
    "MAX_ID",
    "NOT_FOUND",
    "NOT_JSON",
    "NO_SPACE",
    "PRECONDITION",
    "RANGE",
    "TOO_LARGE",
    "TOO_MANY",
    "ErrorBody",
    "ErrorDetail",
    "Responses",
]

Responses = dict[int | str, dict[str, Any]]

# The largest id SQLite stores (a signed 64-bit integer): path and query ids are bounded by it.
MAX_ID = 2**63 - 1


class ErrorDetail(BaseModel):
    """What went wrong. Errors may add detail fields (``path``, ``size``, ``tier``...)."""

    model_config = ConfigDict(extra="allow")

    code: str = Field(description="snake_case error code, stable across versions")
    message: str = Field(description="What went wrong, for a person")
    request_id: str | None = Field(
        default=None, description="The request's id, also in the X-Request-ID header"
    )


class ErrorBody(BaseModel):
    """Every error response's body."""

    error: ErrorDetail


def _err(status: int, description: str, headers: dict[str, str] | None = None) -> Responses:
    """``status`` with the error body, and the headers (name: description) it always carries."""
    out: dict[str, Any] = {"model": ErrorBody, "description": description}
    if headers:
        out["headers"] = {
            name: {"description": text, "required": True, "schema": {"type": "string"}}
            for name, text in headers.items()
        }
    return {status: out}


NOT_FOUND = _err(404, "Not found: no such file, tier, buffer or job")
CONFLICT = _err(409, "Conflict with the current state (exists, busy, migrating, pinned)")
BUSY = _err(503, "Unavailable for now (catalog busy, backend down); retry later")
TOO_MANY = _err(
    429,
    "Too many requests in flight; retry later",
    {"Retry-After": "Seconds to wait before retrying"},
)
NO_SPACE = _err(507, "Not enough space on the tier or budget on the device")
RANGE = _err(416, "Range not satisfiable")
PRECONDITION = _err(412, "The file is not the version If-Match (or If-None-Match: *) names")
TOO_LARGE = _err(413, "Request too large")
BAD_REQUEST = _err(
    400,
    "Malformed request: a body that cannot be decoded, a bad Content-Length, bytes that do not "
    "hash to the checksum sent",
)
INVALID = _err(422, "Invalid parameters or body")
AUTH = _err(401, "Missing or invalid bearer token", {"WWW-Authenticate": "Bearer"})
AUTH_ADMIN = AUTH | _err(403, "The route needs the admin token")

NOT_JSON = _err(
    415,
    "The body was not sent as JSON (send Content-Type: application/json), or a POST was sent as "
    "a form",
)

JSON_BODY = BAD_REQUEST | INVALID
"""What every route that takes a JSON body can answer about it: 400 when the body cannot be
decoded at all (FastAPI's own answer to bytes that are not UTF-8), 422 when it does not validate.
(415, a body not sent as JSON, is added to every such route by ``app.api.openapi``.)"""

DATA = AUTH | TOO_MANY
"""What every data-token route can answer before it runs."""
ADMIN = AUTH_ADMIN | TOO_MANY
"""What every admin-token route can answer before it runs."""
