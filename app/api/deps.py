"""Dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from app.api.responses import MAX_ID
from tiering.engine import Engine
from tiering.serving import Loader

__all__ = ["BY_ID", "EngineDep", "FileId", "LoaderDep"]


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
