"""The dashboard: a static page at ``/`` and ``/ui`` that reads the REST API from the browser.

The page holds no data, so it is served without auth; its script asks for a token when the API
answers 401 and keeps it in ``sessionStorage``. Every asset is a file of this package (no build
step, nothing fetched from elsewhere), served from an allow-list with its content type and a
Content-Security-Policy that admits only scripts, styles and requests of this origin.
"""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter, Response

from app.errors import HttpError

__all__ = ["ASSETS", "CSP", "router"]

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)

# name -> content type; nothing else under /ui/ is served.
ASSETS: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}

_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    # Revalidate every time, so that the page and its script always match the server.
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


@functools.cache
def _read(name: str) -> bytes:
    return resources.files(__name__).joinpath("static", name).read_bytes()


def _asset(name: str) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise HttpError(404, "not_found", f"no dashboard asset {name!r}")
    return Response(_read(name), media_type=media_type, headers=_HEADERS)


@router.get("/")
@router.get("/ui")
@router.get("/ui/")
def index() -> Response:
    """The dashboard page."""
    return _asset("index.html")


@router.get("/ui/{name}")
def asset(name: str) -> Response:
    """A script, style sheet or icon of the dashboard."""
    return _asset(name)
