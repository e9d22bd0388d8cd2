"""Dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from tiering.engine import Engine
from tiering.serving import Loader

__all__ = ["EngineDep", "LoaderDep"]


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
