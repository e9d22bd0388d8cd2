"""The client's errors: one tree, and the one place where an error reply becomes one of them.

::

    TierdClientError
    ├── TransportError            the server could not be reached (connection, timeout)
    ├── JobFailed                 a prefetch waited on with wait=True ended failed
    └── APIError                  the server answered with an error: status, code, message
        ├── InvalidRequest        400, 422: bad input (unknown device, dtype, shape, index)
        ├── RangeNotSatisfiable   416: a range outside the file
        ├── AuthError             401, 403
        ├── NotFound              404: no such file, buffer or job
        ├── Conflict              409
        ├── TooLarge              413: e.g. an index list over the server's limit
        ├── TooManyRequests       429
        ├── InsufficientSpace     507: over a device's lease budget (details say what is free)
        ├── Unavailable           503
        └── ServerError           any other 5xx
"""

from __future__ import annotations

from typing import Any

import httpx

__all__ = [
    "APIError",
    "AuthError",
    "Conflict",
    "InsufficientSpace",
    "InvalidRequest",
    "JobFailed",
    "NotFound",
    "RangeNotSatisfiable",
    "ServerError",
    "TierdClientError",
    "TooLarge",
    "TooManyRequests",
    "TransportError",
    "Unavailable",
    "error_from_response",
]


class TierdClientError(Exception):
    """Base of every error the client raises."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class TransportError(TierdClientError):
    """The server could not be reached, or did not answer in time."""


class JobFailed(TierdClientError):
    """A job waited on ended ``failed``; ``job`` is its final state."""

    def __init__(self, message: str, job: dict[str, Any]) -> None:
        super().__init__(message)
        self.job = job


class APIError(TierdClientError):
    """The server answered with an error.

    Attributes
    ----------
    status:
        HTTP status.
    code:
        The server's snake_case error code (``invalid_range``, ``insufficient_space``...).
    details:
        The error's other fields (sizes, limits, ids), e.g. ``free`` for a 507.
    """

    def __init__(self, status: int, code: str, message: str, details: dict[str, Any]) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.details = details

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"


class InvalidRequest(APIError):
    """400 or 422: bad input (unknown device, dtype, shape, index...)."""


class RangeNotSatisfiable(APIError):
    """416: a range outside the file."""


class AuthError(APIError):
    """401 or 403: no token, a wrong one, or one without the needed role."""


class NotFound(APIError):
    """404: no such file, buffer or job."""


class Conflict(APIError):
    """409: the request conflicts with the current state (e.g. the file exists)."""


class TooLarge(APIError):
    """413: e.g. an index list over the server's limit."""


class TooManyRequests(APIError):
    """429: the server asks to slow down."""


class InsufficientSpace(APIError):
    """507: over a device's lease budget, or no space; ``details`` say what is free."""


class Unavailable(APIError):
    """503: the server is not ready (starting, stopping, a dependency down)."""


class ServerError(APIError):
    """Any other 5xx."""


_BY_STATUS: dict[int, type[APIError]] = {
    400: InvalidRequest,
    401: AuthError,
    403: AuthError,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    416: RangeNotSatisfiable,
    422: InvalidRequest,
    429: TooManyRequests,
    503: Unavailable,
    507: InsufficientSpace,
}


def error_from_response(resp: httpx.Response) -> APIError:
    """The one place where an error reply becomes an exception."""
    try:
        body = resp.json()["error"]
        code, message = str(body.pop("code")), str(body.pop("message"))
        details = dict(body)
    except Exception:
        code, message, details = "http_error", resp.text[:500] or resp.reason_phrase, {}
    cls = _BY_STATUS.get(resp.status_code)
    if cls is None:
        cls = ServerError if resp.status_code >= 500 else APIError
    return cls(resp.status_code, code, message, details)
