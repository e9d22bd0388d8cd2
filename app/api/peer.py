"""Peer reads: the bytes this host holds of a fleet's file, for the other hosts of the fleet.

``GET /v1/peer/content?path=&generation=`` (one ``Range``, or none) serves a byte range of one
generation of a file of the catalog, from bytes this host has verified itself, never from the
file's authority elsewhere (the bucket, another host):

- its copy in the memory tier (filled and checked against the catalog);
- its copy on one of its directory tiers (a host copy, checked when filled);
- the file itself, when the file lives on a tier of this host;
- the pieces its fill of a host copy has verified and written so far (relay: a chain or tree
  of hosts streams at once), from the fill's temp, only of the generation being filled, and
  only a range whose every piece is verified (else 404 ``not_held``: ask another source).

The generation is the receiver's promise about which bytes it wants: a file at another
generation in the catalog is refused with 409 ``generation_mismatch`` (the catalog's current
``generation`` in the body), whatever this host holds, so a peer never serves old bytes as new
ones nor new ones to a receiver that checks them against an old piece map. A file this host
holds no verified bytes of is a 404 ``not_held``, and the receiver asks another source.

A host serves at most :data:`MAX_UPLOADS` peer bodies at once (the per-host cap on concurrent
uploads): past it a 429 ``peer_busy`` sends the receiver to another holder, so a host that
just got the only copy of a piece is not asked for it by the whole fleet at once, and
receivers spread over the hosts that relay it.

Peer reads need the fleet credential (``fleet_token``; the admin and data tokens do not
serve): a receiver's host holds it, a person does not need it. Without it configured, this host
serves no peer reads. A read of a copy counts no access here (it is the receiver's demand,
counted there when it reads its own copy); a read of this host's own file goes through the
engine's one content path, which counts one.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from app.api.deps import EngineDep
from app.api.responses import MAX_ID, NOT_FOUND, RANGE, TOO_MANY, Responses, _err
from app.auth import require_fleet
from app.errors import error_response
from app.ranges import parse_range, reply_range
from tiering.catalog import FileRecord
from tiering.checksum import hex_digest
from tiering.engine import Engine
from tiering.moves import Content
from tiering.tiers import MemoryEntry, MemoryTier
from tiering.tiers.paths import MAX_RELPATH_CHARS

__all__ = ["router"]

router = APIRouter(prefix="/v1/peer", tags=["peer"])

CHUNK = 1 << 20
#: Peer bodies one host serves at once; past it, 429 peer_busy.
MAX_UPLOADS = 4
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


class _Uploads:
    """Peer bodies being served by this app, against :data:`MAX_UPLOADS`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n = 0

    def take(self) -> bool:
        with self.lock:
            if self.n >= MAX_UPLOADS:
                return False
            self.n += 1
            return True

    def give(self) -> None:
        with self.lock:
            self.n -= 1


_UPLOADS_LOCK = threading.Lock()


def _uploads(request: Request) -> _Uploads:
    with _UPLOADS_LOCK:
        up = getattr(request.app.state, "peer_uploads", None)
        if up is None:
            up = request.app.state.peer_uploads = _Uploads()
        return up


class _Held:
    """This host's verified bytes of one generation of a file, from one source (``chunks``
    reads a range), held until :meth:`release`, which lets go of the source once however
    often it is called: at the end of the body, when the client went away mid-body, or, for a
    body never started, when the body is collected (a memory copy held forever could never be
    dropped again)."""

    def __init__(
        self,
        source: str,
        size: int,
        chunks: Callable[[int, int], Iterator[bytes]],
        release: Callable[[], None],
    ) -> None:
        self.source = source
        self.size = size
        self._chunks = chunks
        self._release = release
        self._lock = threading.Lock()
        self._released = False
        self._after: list[Callable[[], None]] = []

    def also(self, step: Callable[[], None]) -> None:
        """Run ``step`` too at the release."""
        self._after.append(step)

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        try:
            self._release()
        finally:
            for step in self._after:
                step()

    def body(self, start: int, end: int, count: Callable[[int], None]) -> Iterator[bytes]:
        """Bytes ``[start, end)``, each chunk counted as it is handed to the server."""

        def gen() -> Iterator[bytes]:
            try:
                for chunk in self._chunks(start, end):
                    count(len(chunk))
                    yield chunk
            finally:
                self.release()

        out = gen()
        weakref.finalize(out, self.release)
        return out


def _of_content(source: str, content: Content) -> _Held:
    return _Held(source, content.size, lambda s, e: content.iter_range(s, e, CHUNK), content.close)


def _of_memory(tier: MemoryTier, entry: MemoryEntry) -> _Held:
    def chunks(start: int, end: int) -> Iterator[bytes]:
        view = entry.view()
        for pos in range(start, end, CHUNK):
            yield view[pos : min(end, pos + CHUNK)].tobytes()

    return _Held("memory", entry.size, chunks, lambda: tier.release(entry))


def _held(engine: Engine, rec: FileRecord) -> _Held | None:
    """This host's verified bytes of ``rec``'s generation: memory, a host copy, or its own
    tier's file; None when it holds none."""
    memory = engine.memory
    if memory is not None:
        entry = memory.tier.acquire(rec.id, rec.generation)
        if entry is not None:
            if entry.size == rec.size:
                return _of_memory(memory.tier, entry)
            memory.tier.release(entry)
    copies = engine.host_copies
    content = copies.content(rec.id) if copies is not None else None
    if content is not None:
        return _of_content("copy", content)
    if rec.host is not None and rec.host == engine.config.host_id:
        # The file lives on a tier of this host: its own fd, at the generation it opened.
        own = engine.open_content(rec.id)
        if own.record.generation == rec.generation and own.size == rec.size:
            return _of_content("tier", own)
        own.close()
    return None


def _filling(engine: Engine, rec: FileRecord, range_header: str | None) -> _Held | None:
    """The asked range of ``rec``'s generation from this host's fill in flight, when every
    piece it touches is verified (read now, so the fill may end while the body streams)."""
    copies = engine.host_copies
    fill = copies.filling(rec.id) if copies is not None else None
    if fill is None or fill.generation != rec.generation or rec.size == 0:
        return None
    start, end = (0, rec.size) if range_header is None else parse_range(range_header, rec.size)
    data = fill.read_range(start, end)
    if data is None:
        return None

    def chunks(s: int, e: int) -> Iterator[bytes]:
        yield data[s - start : e - start]

    # The body is exactly the range read: the route below asks for that same range again.
    return _Held("filling", rec.size, chunks, lambda: None)


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
    uploads = _uploads(request)
    if not uploads.take():
        return error_response(
            429, "peer_busy", f"this host serves {MAX_UPLOADS} peer reads already; ask another"
        )
    try:
        held = _held(engine, rec) or _filling(engine, rec, request.headers.get("range"))
    except BaseException:
        uploads.give()
        raise
    if held is None:
        uploads.give()
        return error_response(
            404, "not_held", f"this host holds no verified bytes of {path!r} at {generation}"
        )
    try:
        headers = {
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            GENERATION_HEADER: str(generation),
            SOURCE_HEADER: held.source,
        }
        if rec.checksum:
            headers["ETag"] = f'"{hex_digest(rec.checksum)}"'
        start, end, status = reply_range(request.headers.get("range"), held.size, headers)
    except BaseException:
        held.release()
        uploads.give()
        raise
    held.also(uploads.give)  # the upload ends when the source is let go of
    counter = request.app.state.metrics.peer_bytes_served.labels(held.source)
    body = held.body(start, end, counter.inc)
    return StreamingResponse(body, status_code=status, headers=headers)
