"""Peer reads: the bytes this host holds of a fleet's file, for the other hosts of the fleet.

``GET /v1/peer/content?path=&generation=`` (one ``Range``, or none) serves a byte range of one
generation of a file of the catalog, from bytes this host has verified itself, never from the
file's authority elsewhere (the bucket, another host). Which verified copy serves it (memory
tier, host copy, its own tier's file, or the verified pieces of a fill in flight) and the cap on
uploads at once are decided by :class:`tiering.fleet.PeerUploads`; this module parses,
authorizes and streams.

The generation is the receiver's promise about which bytes it wants: a file at another
generation in the catalog is refused with 409 ``generation_mismatch`` (the catalog's current
``generation`` in the body), whatever this host holds, so a peer never serves old bytes as new
ones nor new ones to a receiver that checks them against an old piece map. A range the file
cannot satisfy is a 416. A file this host holds no verified bytes of (of that range, for a fill
in flight) is a 404 ``not_held``, and the receiver asks another source. Past
:data:`~tiering.fleet.MAX_UPLOADS` bodies at once, a 429 ``peer_busy`` sends the receiver to
another holder.

Peer reads need the fleet credential (``fleet_token``; the admin and data tokens do not
serve): a receiver's host holds it, a person does not need it. Without it configured, this host
serves no peer reads. A read of a copy counts no access here (it is the receiver's demand,
counted there when it reads its own copy); a read of this host's own file goes through the
engine's one content path, which counts one.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from app.aborts import guard_body
from app.api.deps import EngineDep
from app.api.responses import MAX_ID, NOT_FOUND, RANGE, TOO_MANY, Responses, _err
from app.auth import require_fleet
from app.errors import error_response
from app.ranges import reply_range
from tiering.checksum import hex_digest
from tiering.engine import Engine
from tiering.errors import Unavailable
from tiering.fleet import PeerUploads
from tiering.fleet.peerfetch import NotHeld, PeerBusy
from tiering.tiers.paths import MAX_RELPATH_CHARS

__all__ = ["router"]

router = APIRouter(prefix="/v1/peer", tags=["peer"])

GENERATION_HEADER = "X-Tierd-Generation"
SOURCE_HEADER = "X-Tierd-Source"

FLEET_AUTH = _err(
    401,
    "Missing or wrong fleet credential (fleet_token), or none configured on this host",
    {"WWW-Authenticate": "Bearer"},
)
STALE = _err(
    409,
    "generation_mismatch: the file is at another generation in the catalog (its current "
    "generation is in the body); the receiver's piece map is stale",
)
_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
_HEADERS = {
    "Accept-Ranges": {"required": True, "schema": {"type": "string", "enum": ["bytes"]}},
    GENERATION_HEADER: {
        "required": True,
        "description": "The generation served: always the one asked for",
        "schema": {"type": "string"},
    },
    SOURCE_HEADER: {
        "required": True,
        "description": "Where on this host the bytes come from: memory, copy, tier, or the "
        "verified pieces of a fill in flight (filling)",
        "schema": {"type": "string", "enum": ["memory", "copy", "tier", "filling"]},
    },
}
BYTES: Responses = {
    200: {"description": "The whole file", "content": _BINARY, "headers": _HEADERS},
    206: {
        "description": "One byte range",
        "content": _BINARY,
        "headers": _HEADERS | {"Content-Range": {"required": True, "schema": {"type": "string"}}},
    },
}
PEER: Responses = FLEET_AUTH | TOO_MANY | NOT_FOUND | STALE | RANGE


@router.get(
    "/content",
    dependencies=[require_fleet],
    response_class=Response,
    responses=BYTES | PEER,
)
def peer_content(
    request: Request,
    engine: EngineDep,
    path: Annotated[
        str,
        Query(min_length=1, max_length=MAX_RELPATH_CHARS * 4, description="The file's relpath"),
    ],
    generation: Annotated[
        int, Query(ge=0, le=MAX_ID, description="The generation whose bytes are wanted")
    ],
) -> Response:
    """Bytes of ``generation`` of a fleet's file that this host holds verified (memory tier,
    host copy, or its own tier); see the module docstring. One ``Range`` gives 206."""
    rec = engine.lookup(path)
    if rec.generation != generation:
        return error_response(
            409,
            "generation_mismatch",
            f"{path!r} is at generation {rec.generation}, not {generation}",
            generation=rec.generation,
            asked=generation,
        )
    headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
    start, end, status = reply_range(request.headers.get("range"), rec.size, headers)
    try:
        body = _peers(engine).open(rec, start, end)
    except PeerBusy as exc:
        return error_response(429, exc.code, exc.message)
    except NotHeld as exc:
        return error_response(404, exc.code, exc.message)
    try:
        headers |= {GENERATION_HEADER: str(generation), SOURCE_HEADER: body.source}
        if rec.checksum:
            headers["ETag"] = f'"{hex_digest(rec.checksum)}"'
        counter = request.app.state.metrics.peer_bytes_served.labels(body.source)
        stream = guard_body(body.stream(counter.inc))  # damage: the connection is cut
    except BaseException:
        body.release()  # the body never started: its source and upload slot go now
        raise
    return StreamingResponse(stream, status_code=status, headers=headers)


def _peers(engine: Engine) -> PeerUploads:
    if engine.peers is None:
        raise Unavailable("the engine is not open")
    return engine.peers
