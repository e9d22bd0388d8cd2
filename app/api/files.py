"""Files: list, look up, read (with Range), upload, delete."""

from __future__ import annotations

import base64
import binascii
import itertools
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers

from app.aborts import guard_body
from app.api.allow import is_head
from app.api.deps import BY_ID, EngineDep, FileId, LoaderDep
from app.api.responses import (
    ADMIN,
    BAD_REQUEST,
    BUSY,
    CONFLICT,
    DATA,
    INVALID,
    NO_SPACE,
    NOT_FOUND,
    PRECONDITION,
    RANGE,
    TOO_LARGE,
)
from app.auth import require_admin, require_data
from app.conditions import etag, last_modified, read_precondition, upload_precondition
from app.errors import HttpError, error_response
from app.ranges import reply_range
from app.schemas import FileList, FileOut
from tiering.catalog import FileState
from tiering.engine import Engine, Upload
from tiering.errors import AlreadyExists, PreconditionFailed
from tiering.tiers.paths import MAX_RELPATH_CHARS

router = APIRouter(prefix="/v1/files", tags=["files"])

UPLOAD_BUFFER = 1 << 20
#: Where a content read's bytes come from: storage (a tier of this host, or its copy),
#: object_store (the bucket) or peer (other hosts of the fleet).
SOURCE = "X-Tierd-Source"
CHECKSUM_PATTERN = r"^xxh3_128:[0-9a-f]{32}$"
MAX_PAGE = 1000


def _out(engine: Engine, rec: Any) -> FileOut:
    return FileOut.of(rec, engine.heat(rec))


def _encode_cursor(last_id: int) -> str:
    return base64.urlsafe_b64encode(f"id:{last_id}".encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        kind, _, value = raw.partition(":")
        if kind != "id" or not value.isdigit():
            raise ValueError(raw)
        return int(value)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise HttpError(422, "invalid_cursor", "cursor is not one this server issued") from None


# The engine checks a relpath's rules (and answers ``invalid_path`` with the rule broken); the
# schema states the length bound it enforces, while pydantic only caps what is read at 4x that.
PathQuery = Annotated[
    str,
    Query(
        max_length=MAX_RELPATH_CHARS * 4,
        description="File relpath",
        json_schema_extra={"minLength": 1, "maxLength": MAX_RELPATH_CHARS},
    ),
]

_BYTES = {"schema": {"type": "string", "format": "binary"}}
_CONTENT_HEADERS = {
    "Accept-Ranges": {"required": True, "schema": {"type": "string", "enum": ["bytes"]}},
    "ETag": {
        "description": "The file's checksum, while the bytes match the catalog's record",
        "schema": {"type": "string"},
    },
    "Last-Modified": {
        "description": "The file's mtime as the catalog recorded it",
        "schema": {"type": "string"},
    },
    SOURCE: {
        "description": "Where the bytes come from: storage (this host's tier or copy), "
        "object_store (the bucket) or peer (the fleet's other hosts)",
        "schema": {"type": "string", "enum": ["storage", "object_store", "peer"]},
    },
}
# An upload's answer names the version it wrote, for a later If-Match or If-None-Match.
_VERSION_HEADERS = {k: _CONTENT_HEADERS[k] for k in ("ETag", "Last-Modified")}
_UPLOADED: dict[int | str, dict[str, Any]] = {
    200: {
        "model": FileOut,
        "description": "Replaced (overwrite=true, or If-Match)",
        "headers": _VERSION_HEADERS,
    },
    201: {"description": "Created", "headers": _VERSION_HEADERS},
}


def _header(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "header", "description": description, "schema": {"type": "string"}}


_IF_MATCH = _header(
    "If-Match",
    "ETags (quoted, comma-separated) one of which the file must be now, or *: a 412 otherwise",
)
_IF_NONE_MATCH_READ = _header(
    "If-None-Match", "ETags of copies the client has (or *): a 304 if one is current"
)
_CONDITIONAL_READ = [
    _IF_MATCH,
    _IF_NONE_MATCH_READ,
    _header("If-Modified-Since", "An HTTP date: a 304 if the file is not newer (no If-None-Match)"),
]
_CONDITIONAL_UPLOAD = [
    _IF_MATCH
    | {
        "description": "The ETag of the version to replace (or *: any, but it must "
        "exist): a 412 otherwise, and nothing written"
    },
    _header("If-None-Match", "*: only if the file does not exist (a 412 otherwise)"),
]
_RANGE_416 = {
    416: RANGE[416]
    | {
        "headers": {
            "Content-Range": {"description": "bytes */<size>", "schema": {"type": "string"}}
        }
    }
}


@router.get("", dependencies=[require_data], responses=DATA | NOT_FOUND | INVALID | BUSY)
def list_files(
    engine: EngineDep,
    tier: Annotated[str | None, Query(description="Only files on this tier")] = None,
    prefix: Annotated[str | None, Query(max_length=4096, description="Relpath prefix")] = None,
    state: Annotated[
        str | None,
        Query(
            description="Only files in this state; default all but missing",
            json_schema_extra={"enum": list(FileState.ALL)},
        ),
    ] = None,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> FileList:
    """Files ordered by id, a page at a time; follow ``next_cursor`` for the next page."""
    if tier is not None:
        engine.tiers.get(tier)
    if state is not None and state not in FileState.ALL:
        raise HttpError(422, "invalid_state", f"state must be one of {', '.join(FileState.ALL)}")
    states = [state] if state else [s for s in FileState.ALL if s != FileState.MISSING]
    after = _decode_cursor(cursor) if cursor else 0
    recs = engine.catalog.page(
        tier=tier, prefix=prefix, states=states, after_id=after, limit=limit + 1
    )
    more = len(recs) > limit
    recs = recs[:limit]
    return FileList(
        items=[_out(engine, r) for r in recs],
        next_cursor=_encode_cursor(recs[-1].id) if more else None,
    )


@router.delete("", dependencies=[require_admin], responses=ADMIN | INVALID | BUSY)
def purge(
    engine: EngineDep,
    state: Annotated[
        str,
        Query(
            description="Only 'missing' may be purged",
            json_schema_extra={"enum": [FileState.MISSING]},
        ),
    ],
) -> dict[str, int]:
    """Forget files that are gone from disk (``state=missing``); their bytes are already gone."""
    if state != FileState.MISSING:
        raise HttpError(
            422, "invalid_state", "only records in state 'missing' can be purged in bulk"
        )
    return {"purged": engine.catalog.purge_missing()}


@router.get("/lookup", dependencies=[require_data], responses=DATA | NOT_FOUND | INVALID | BUSY)
def lookup(engine: EngineDep, path: PathQuery) -> FileOut:
    """One file by relpath."""
    return _out(engine, engine.lookup(path))


@router.put(
    "/content",
    dependencies=[require_data],
    status_code=201,
    response_model=FileOut,
    responses=_UPLOADED
    | DATA
    | BAD_REQUEST
    | NOT_FOUND
    | CONFLICT
    | PRECONDITION
    | TOO_LARGE
    | INVALID
    | BUSY
    | NO_SPACE,
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "The file's bytes, streamed",
            "content": {"application/octet-stream": _BYTES},
        },
        "parameters": _CONDITIONAL_UPLOAD,
    },
)
async def upload(
    request: Request,
    engine: EngineDep,
    path: PathQuery,
    tier: Annotated[
        str | None,
        Query(
            description="Tier to write to; default the file's current tier, else the default tier"
        ),
    ] = None,
    overwrite: bool = False,
    checksum: Annotated[
        str | None,
        Query(
            pattern=CHECKSUM_PATTERN,
            description="What the bytes hash to (xxh3_128:<32 hex>, as tierd records it): "
            "bytes that do not are a 400 checksum_mismatch and nothing is written",
        ),
    ] = None,
) -> JSONResponse:
    """Upload a file's bytes: streamed to a temp file, fsynced, published without clobbering,
    then recorded. 201 for a new file, 200 when ``overwrite`` replaced one.

    ``If-Match`` (the ETag of the version to replace, or ``*``) and ``If-None-Match: *`` make
    it conditional: a 412 before a byte is written when the file is not as they say."""
    up, must_not_exist = await run_in_threadpool(
        _begin_upload, request.headers, engine, path, tier, overwrite, checksum
    )
    replaced = up.replaces is not None
    try:
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) >= UPLOAD_BUFFER:
                await run_in_threadpool(up.write, bytes(buf))
                buf.clear()
        if buf:
            await run_in_threadpool(up.write, bytes(buf))
        rec = await run_in_threadpool(up.commit)
    except AlreadyExists as exc:
        if must_not_exist:  # created by another upload meanwhile
            raise PreconditionFailed(
                f"{path!r} was created during the upload (If-None-Match: *); nothing was written",
                path=path,
            ) from exc
        raise
    finally:
        await run_in_threadpool(up.abort)
    body = _out(engine, rec).model_dump(mode="json")
    headers = {"Last-Modified": last_modified(rec.mtime_ns)}
    if (tag := etag(rec.checksum)) is not None:
        headers["ETag"] = tag
    return JSONResponse(body, status_code=200 if replaced else 201, headers=headers)


def _begin_upload(
    headers: Headers,
    engine: Engine,
    path: str,
    tier: str | None,
    overwrite: bool,
    checksum: str | None,
) -> tuple[Upload, bool]:
    """Start an upload as its conditions (``If-Match``, ``If-None-Match: *``) and its
    ``Content-Length`` allow; also whether it must create the file."""
    if_match, must_not_exist = upload_precondition(headers)
    if must_not_exist and engine.catalog.find(path) is not None:
        raise PreconditionFailed(f"{path!r} exists (If-None-Match: *); nothing was written")
    length = headers.get("content-length")
    expected: int | None = None
    if length is not None:
        if not length.isdigit():
            raise HttpError(400, "invalid_content_length", "Content-Length must be an integer")
        expected = int(length)
    up = engine.begin_upload(
        path,
        tier=tier,
        # If-Match replaces the version it names; If-None-Match: * never clobbers a file that
        # another upload publishes meanwhile (AlreadyExists, a 412 above).
        overwrite=(overwrite or if_match is not None) and not must_not_exist,
        expected_size=expected,
        checksum=checksum,
        if_match=if_match,
    )
    return up, must_not_exist


@router.get(BY_ID, dependencies=[require_data], responses=DATA | NOT_FOUND | INVALID | BUSY)
def get_file(engine: EngineDep, file_id: FileId) -> FileOut:
    """One file by id."""
    return _out(engine, engine.get(file_id))


def _unread(status: int, headers: dict[str, str], relpath: str) -> Response:
    """A conditional read's answer without the body: 304 (the client's copy is current), or
    412 (the file is not the version ``If-Match`` names)."""
    if status == 304:
        keep = ("ETag", "Last-Modified")
        return Response(status_code=304, headers={k: headers[k] for k in keep if k in headers})
    return error_response(
        412,
        "precondition_failed",
        f"{relpath!r} is not at the version If-Match names",
        headers={k: headers[k] for k in ("ETag", "Last-Modified") if k in headers},
    )


@router.get(
    BY_ID + "/content",
    dependencies=[require_data],
    response_class=Response,
    responses={
        200: {
            "description": "The whole file",
            "content": {"application/octet-stream": _BYTES},
            "headers": _CONTENT_HEADERS,
        },
        206: {
            "description": "One byte range",
            "content": {"application/octet-stream": _BYTES},
            "headers": _CONTENT_HEADERS
            | {"Content-Range": {"required": True, "schema": {"type": "string"}}},
        },
        304: {
            "description": "Not modified: If-None-Match names the current ETag, or the file "
            "is not newer than If-Modified-Since (no body, no access counted)",
            "headers": {k: _CONTENT_HEADERS[k] for k in ("ETag", "Last-Modified")},
        },
    }
    | DATA
    | PRECONDITION
    | NOT_FOUND
    | CONFLICT
    | _RANGE_416
    | INVALID
    | BUSY,
    openapi_extra={"parameters": _CONDITIONAL_READ},
)
def read_content(
    request: Request, engine: EngineDep, loader: LoaderDep, file_id: FileId
) -> Response:
    """The file's bytes, streamed from the fd opened for this request. One ``Range`` gives 206;
    an unsatisfiable or multi-part one gives 416. Counts one access (a HEAD or a 416 none).

    The first chunk is read before the status line is sent: a file changed or removed behind
    tierd's back is then a 409, never a 200 cut short. That lets an object be opened from the
    catalog's ETag without a HEAD (every ranged GET carries ``If-Match``), so a small range is
    one request to the store. A HEAD answers the headers alone, from the file as it was
    opened: no byte is read.

    A fleet's shared file this host holds no copy of is read from the peers that hold it
    (each piece checked against the generation's map; the bucket for what no peer gives), as
    loads read it: ``X-Tierd-Source`` says ``peer``."""
    content = engine.open_content(file_id, trust_catalog=True, count=False, via=loader.peer_source)
    try:
        rec = content.record
        size = content.size
        ranges = content.source.ranges
        headers = {
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "Last-Modified": last_modified(rec.mtime_ns),
            SOURCE: ranges.source if ranges is not None else "storage",
        }
        # The checksum names the bytes recorded; if the file changed on disk outside tierd
        # (size differs) the ETag would lie, so leave it off until a scan rehashes.
        tag = etag(rec.checksum) if size == rec.size else None
        if tag is not None:
            headers["ETag"] = tag
        answer = read_precondition(request.headers, tag, rec.mtime_ns)
        if answer is not None:  # 304 or 412: nothing is read, no access counted
            content.close()
            return _unread(answer, headers, rec.relpath)
        range_header = request.headers.get("range")
        if range_header is not None:
            if_range = request.headers.get("if-range")
            if if_range is not None and if_range != headers.get("ETag"):
                range_header = None  # the client's copy is stale: send it all
        start, end, status = reply_range(range_header, size, headers)
    except BaseException:
        content.close()
        raise
    if is_head(request.scope):  # a HEAD reads nothing (no access, no heat), nor does a 416
        content.close()
        return Response(status_code=status, headers=headers)
    engine.count_access(rec.id)
    chunks = content.iter_range(start, end)
    first = next(chunks, None)  # raises FileChanged (409) here; the generator closes the source
    second = None if first is None else next(chunks, None)
    if first is None or second is None:
        # The whole body in hand (a small range: most reads), checked as the first chunk is:
        # sent as it is, where a stream costs two more trips to the thread pool, half of a
        # 4 KiB read's CPU in the server.
        return Response(first or b"", status_code=status, headers=headers)
    body = itertools.chain((first, second), chunks)
    # Damage in a later chunk cuts the connection (app.aborts): no 200 ends short and clean.
    return StreamingResponse(guard_body(body), status_code=status, headers=headers)


@router.delete(
    BY_ID,
    dependencies=[require_admin],
    responses=ADMIN | NOT_FOUND | CONFLICT | INVALID | BUSY,
)
def delete_file(engine: EngineDep, file_id: FileId) -> dict[str, FileOut]:
    """Remove a file's bytes from its tier and its record from the catalog."""
    rec = engine.delete(file_id)
    return {"deleted": _out(engine, rec)}
