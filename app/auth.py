"""Bearer tokens: the admin token may do everything, the data token the data routes; the fleet
credential (``fleet_token``) the peer routes, and nothing else."""

from __future__ import annotations

import hmac
from enum import StrEnum
from typing import Annotated

from fastapi import Depends, Request

from app.errors import HttpError

__all__ = ["Role", "require_admin", "require_data", "require_fleet"]


class Role(StrEnum):
    admin = "admin"
    data = "data"


def _same(a: str, b: str | None) -> bool:
    return b is not None and hmac.compare_digest(a.encode(), b.encode())


def _role(request: Request) -> Role:
    settings = request.app.state.settings
    if not settings.auth_enabled:
        # No tokens: tierd only binds loopback (checked at start), so the caller is local.
        return Role.admin
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HttpError(
            401,
            "unauthorized",
            "missing bearer token: send 'Authorization: Bearer <token>'",
            {"WWW-Authenticate": "Bearer"},
        )
    token = token.strip()
    if _same(token, settings.admin_token):
        return Role.admin
    if _same(token, settings.data_token):
        return Role.data
    raise HttpError(401, "unauthorized", "invalid token", {"WWW-Authenticate": "Bearer"})


# Async so FastAPI calls them on the event loop instead of hopping to the thread pool.
async def _data(request: Request) -> Role:
    return _role(request)


async def _admin(request: Request) -> Role:
    role = _role(request)
    if role is not Role.admin:
        raise HttpError(403, "forbidden", "this route needs the admin token")
    return role


async def _fleet(request: Request) -> None:
    # Only the fleet credential: a host's admin or data token is for people and schedulers,
    # and a peer read is for the fleet's hosts, which hold this one credential.
    expected = request.app.state.settings.fleet_token
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if expected is None:
        message = "this host serves no peer reads: it has no fleet credential (fleet_token)"
    elif scheme.lower() != "bearer" or not _same(token.strip(), expected):
        message = "peer reads need the fleet credential: 'Authorization: Bearer <fleet_token>'"
    else:
        return
    raise HttpError(401, "unauthorized", message, {"WWW-Authenticate": "Bearer"})


require_data = Depends(_data)
require_fleet = Depends(_fleet)
require_admin = Depends(_admin)
DataRole = Annotated[Role, require_data]
AdminRole = Annotated[Role, require_admin]
