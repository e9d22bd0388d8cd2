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
  answer, and some (a form's POST, a body-less ``fetch`` POST, an ``<img>``'s GET) go without
  the browser asking first; ``POST /v1/files/{id}/pin``, running the plan, a scan or a stats
  reset need no body, and a content read counts an access (heat). A browser says where a
  request comes from: ``Sec-Fetch-Site`` on every request (Chrome since 2019, Firefox 2021,
  Safari 2023), and ``Origin`` on every request but a GET or HEAD that is not CORS (``null``
  where the page hides it). A request marked as another site's (``Sec-Fetch-Site``
  ``cross-site`` or ``same-site``; without it, an ``Origin`` that is not tierd's own) is
  refused with 403 (``cross_site_request``), whatever its method, unless it is the user
  following a link to a page of tierd's (a top-level GET navigation the user started:
  ``Sec-Fetch-Mode: navigate``, ``Sec-Fetch-Dest: document``, ``Sec-Fetch-User: ?1``). The
  dashboard, served by tierd itself, is the same origin and passes; curl, scripts and tierd's
  clients send neither header and pass.

A browser too old to send ``Origin`` on a form's POST (Firefox before 70, 2019) still sends the
form's ``Content-Type``, and a POST sent as a form or plain text is a 415 whatever the tokens
(:func:`app.api.deps.json_bodies`: tierd takes no forms). With tokens configured neither check
here runs unless ``allowed_hosts`` is set: a page has no token to send, and tierd may be reached
by any name a fleet or a load balancer gives it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import error_response

__all__ = ["BrowserGuard", "host_name"]

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
    """Refuses, as a JSON error, a request with a foreign ``Host`` (421) and a request a page of
    another site made (403); see the module.

    ``names``: the host names tierd answers to besides loopback names; ``port``: the port it
    listens on; ``origins``: origins of its own besides a known name on that port (its
    ``advertise_url``'s, where a proxy or a port mapping puts it on another port)."""

    def __init__(
        self, app: ASGIApp, *, names: Iterable[str], port: int, origins: Iterable[str] = ()
    ) -> None:
        self.app = app
        self.names = {host_name(n) for n in names if n}
        self.port = port
        self.origins = {o for o in map(_origin, origins) if o is not None}

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
        if self._cross_site(scope["method"], headers):
            response = error_response(
                403,
                "cross_site_request",
                "this request was made by a web page of another site; a tierd without tokens "
                "takes requests only from its own pages, scripts and clients, and from a "
                "browser only the user following a link to one of its pages (configure tokens "
                "to accept requests from anywhere that holds one)",
                origin=headers.get("origin"),
                site=headers.get("sec-fetch-site"),
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _cross_site(self, method: str, headers: dict[str, str]) -> bool:
        site = headers.get("sec-fetch-site")
        if site in ("cross-site", "same-site"):
            # The user following a link to a page of tierd's passes: a top-level GET navigation
            # the user started (a page sending its own window there has no ?1).
            return not (
                method == "GET"
                and headers.get("sec-fetch-mode") == "navigate"
                and headers.get("sec-fetch-dest", "document") == "document"
                and headers.get("sec-fetch-user") == "?1"
                and headers.get("origin") is None
            )
        if site is not None:
            return False  # same-origin, or none (the user's own: the address bar, a bookmark)
        origin = headers.get("origin")
        if origin is None:
            return False  # no browser sent it (or a same-origin GET, which carries none)
        return not self._own(origin, headers.get("host", ""))

    def _own(self, origin: str, host: str) -> bool:
        """Whether ``origin`` is one of tierd's own: the origin this request was sent to (its
        ``Host``, already known to be one of tierd's names: an SSH tunnel's or a port
        mapping's port is the browser's origin), one of its names on its port, or one of
        ``origins``. ``null`` (a sandboxed or file:// page, a redirect across sites) is not,
        nor is another local server's page: another origin, as a browser sees it."""
        own = _origin(origin)
        if own is None:
            return False
        scheme, name, port = own
        if host and _origin(f"{scheme}://{host}") == own:
            return True
        return (self._known(name) and port == self.port) or own in self.origins


def _origin(value: str) -> tuple[str, str, int] | None:
    """An origin (or URL) as (scheme, host, port), or None (``null``, or not one)."""
    parts = urlsplit(value.strip().lower())
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.scheme, parts.hostname, port
