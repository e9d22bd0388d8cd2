"""Dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from tiering.engine import Engine
from tiering.loader import Loader

__all__ = ["EngineDep", "LoaderDep"]


def _engine(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


EngineDep = Annotated[Engine, Depends(_engine)]


def _loader(request: Request) -> Loader:
    loader: Loader = request.app.state.loader
    return loader


LoaderDep = Annotated[Loader, Depends(_loader)]
