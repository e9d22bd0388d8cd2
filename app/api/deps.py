"""Dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from app.api.responses import MAX_ID
from app.errors import HttpError
from tiering.engine import Engine
from tiering.serving import Loader

__all__ = ["BY_ID", "EngineDep", "FileId", "LoaderDep", "json_bodies"]


# These are async on purpose: FastAPI runs a sync dependency in the thread pool, and a thread
# hop per dependency costs more than a 4 KiB load's read. They do no blocking work.
async def _engine(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


EngineDep = Annotated[Engine, Depends(_engine)]


async def _loader(request: Request) -> Loader:
    loader: Loader = request.app.state.loader
    return loader


LoaderDep = Annotated[Loader, Depends(_loader)]


FileId = Annotated[int, Path(ge=1, le=MAX_ID, description="Catalog id of the file")]
# The path of a file's routes. ``{file_id:int}`` routes only digits there, so that
# ``/v1/files/lookup`` and ``/v1/files/content`` are never taken for a file id (another method
# on them is a 405 with an exact ``Allow``, not a 422), and a non-numeric id is a 404 like any
# unknown path. Ids out of SQLite's range still reach the route, and fail its bounds: 422.
BY_ID = "/{file_id:int}"


#: The types a web page's form (or a ``fetch`` without a CORS preflight) may send a body as.
FORM_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"})


async def json_bodies(request: Request) -> None:
    """Every route's: a body sent to a route that reads JSON must be sent as JSON, else 415; and
    a POST sent as a form (``FORM_TYPES``), with a body or none, is a 415 on every route.

    A web page can send a form or plain text to 127.0.0.1 without asking first (no CORS
    preflight), and a tierd without tokens would act on it; a JSON body makes the browser ask,
    and tierd answers no CORS. FastAPI leaves such a body unparsed, so a typed route answered a
    422 that never named the cause, and a route taking any JSON value got the raw bytes.
    """
    headers = request.headers
    sent = headers.get("content-type")
    media = (sent or "").split(";", 1)[0].strip().lower()
    if request.method == "POST" and media in FORM_TYPES:
        # What a page's form sends, even with no body and from a browser too old to say whose
        # page it is (no Origin): tierd takes no forms, so no route acts on one.
        raise HttpError(
            415,
            "unsupported_media_type",
            f"a POST sent as {sent!r} is what a web page's form sends, and tierd takes no "
            "forms: send no body and no Content-Type, or JSON with 'Content-Type: "
            "application/json' (curl: drop -d, or use --json)",
        )
    if getattr(request.scope.get("route"), "body_field", None) is None:
        return  # no JSON body read here (none at all, or a stream: an upload's bytes)
    if headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers:
        return  # no body: a missing required one is the route's 422
    if media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    ):
        return
    said = f"it was sent as {sent!r}" if sent else "it came without a Content-Type"
    raise HttpError(
        415,
        "unsupported_media_type",
        f"the body must be JSON sent with 'Content-Type: application/json'; {said} "
        "(curl: add -H 'Content-Type: application/json', or use --json)",
    )
