"""What keeps a tierd without tokens safe from web pages.

Without tokens tierd listens on loopback only (:func:`app.main.check_bind`), but a browser on
the same machine reaches loopback too, on behalf of any page it shows. Two ways in, two checks
(:class:`BrowserGuard`, pure ASGI middleware, in front of every route):

- **DNS rebinding**: a page at ``attacker.example`` whose name is re-pointed to 127.0.0.1 may
  read every answer, since the browser takes it for the page's own origin. Its requests carry
  ``Host: attacker.example``: a request whose ``Host`` is not a loopback name (``localhost``,
  ``127.0.0.1``, ``[::1]``), the address tierd listens on, its ``advertise_url``'s host or one
  of ``allowed_hosts`` is refused with 421 (Misdirected Request) before any route runs.
- **Cross-site requests**: a page may *send* requests to any origin without reading the
  answer, and some (a form's POST, or a body-less ``fetch`` POST) go without the browser
  asking first; ``POST /v1/files/{id}/pin``, running the plan, a scan or a stats reset need no
  body. A browser says where a request comes from (``Origin``, and ``Sec-Fetch-Site``), so a
  request that changes state (any method but GET, HEAD and OPTIONS) from another site is
  refused with 403 (``cross_site_request``). The dashboard, served by tierd itself, is the
  same origin and passes; curl, scripts and tierd's clients send neither header and pass.

With tokens configured neither check runs unless ``allowed_hosts`` is set: a page has no token
to send, and tierd may be reached by any name a fleet or a load balancer gives it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import error_response

__all__ = ["BrowserGuard", "host_name"]

_SAFE = frozenset({"GET", "HEAD", "OPTIONS"})
_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


def host_name(value: str) -> str:
    """The name of a ``Host`` header or URL authority, without its port, lower-cased
    (``[::1]:8470`` -> ``::1``)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _loopback(name: str) -> bool:
    if name in _LOOPBACK or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class BrowserGuard:
    """Refuses, as a JSON error, a request with a foreign ``Host`` (421) and a state-changing
    request from another site (403); see the module."""

    def __init__(self, app: ASGIApp, *, names: Iterable[str], port: int) -> None:
        self.app = app
        self.names = {host_name(n) for n in names if n}
        self.port = port

    def _known(self, name: str) -> bool:
        return name in self.names or _loopback(name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = host_name(headers.get("host", ""))
        if host and not self._known(host):
            response = error_response(
                421,
                "unknown_host",
                f"this tierd answers to loopback names and its own (not {host!r}): a request "
                "naming another host may come from a page re-pointed at it (DNS rebinding); "
                "list the name in allowed_hosts if it is yours",
                host=host,
            )
            await response(scope, receive, send)
            return
        if scope["method"] not in _SAFE and self._cross_site(headers):
            response = error_response(
                403,
                "cross_site_request",
                "a request that changes state was sent by a web page of another site; a tierd "
                "without tokens takes such requests only from its own pages, scripts and "
                "clients (configure tokens to accept them from anywhere that holds one)",
                origin=headers.get("origin"),
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _cross_site(self, headers: dict[str, str]) -> bool:
        site = headers.get("sec-fetch-site")
        if site in ("cross-site", "same-site"):
            return True
        origin = headers.get("origin")
        if origin is None:
            return False  # no browser sent it (or one that says nothing: same-origin GETs)
        if origin == "null":
            return True  # a sandboxed page, a file:// page, a redirect across sites
        parts = urlsplit(origin)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            return True
        # tierd's own pages: one of its names, on its port (another local server's page is
        # another origin, as a browser sees it).
        return not (parts.hostname and self._known(parts.hostname.lower()) and port == self.port)
