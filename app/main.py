"""The ASGI app: ``create_app(settings)``; its lifespan starts and stops the engine."""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import Depends, FastAPI
from starlette.concurrency import run_in_threadpool

import tiering
from app.aborts import AbortedStreams, QuietAborts
from app.api import (
    buffers,
    files,
    fleet,
    fleet_heat,
    health,
    heat,
    history,
    jobs,
    loads,
    migrations,
    models,
    peer,
    pins,
    placement,
    policy,
    stats,
    tiers,
)
from app.api.allow import HeadAsGet
from app.api.deps import json_bodies
from app.api.docs import install_docs
from app.api.openapi import install_openapi
from app.browsers import BrowserGuard
from app.errors import install_error_handlers
from app.limits import InflightLimit
from app.logs import RequestId
from app.metrics import HttpMetrics, Metrics
from app.metrics import router as metrics_router
from app.settings import Settings, get_settings
from app.ui import router as ui_router
from tiering.engine import Engine
from tiering.serving import Loader
from tiering.serving.fleetjobs import FleetWorker

__all__ = ["UnsafeBind", "check_bind", "create_app"]

log = logging.getLogger("tierd")

#: The GIL's switch interval while tierd serves (CPython's default is 5 ms). A busy server's
#: event loop holds the GIL most of the time, and each of its other threads waits up to this
#: long to take it back after every blocking call: a request's hop to the thread pool, and
#: each system call and catalog statement of a move, dozens a move. Measured on the 2-core
#: machine with 16 client processes (``tierd bench serving``, a log of each move's steps): at
#: 1 ms a move's commit step took 18.5 ms against 32 ms, its request's claim 32 against 43 ms,
#: and moves 1.42x their time alone against 1.48x (medians of four alternated runs), with the
#: requests' rate and p99 unchanged.
SWITCH_INTERVAL_S = 0.001


class UnsafeBind(RuntimeError):
    """Refusing to listen beyond loopback with no tokens configured."""


def check_bind(settings: Settings) -> None:
    """Refuse a non-loopback address without tokens; say so when serving open on loopback."""
    if settings.auth_enabled:
        return
    if not settings.is_loopback():
        raise UnsafeBind(
            f"refusing to listen on {settings.host} with no tokens: set TIERD_ADMIN_TOKEN "
            "(and TIERD_DATA_TOKEN), or listen on 127.0.0.1"
        )
    log.warning("no tokens configured: serving without auth on loopback %s only", settings.host)


def lifespan(
    settings: Settings, engine: Engine, loader: Loader
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The server's life: the GIL's switch interval set (kept for the process's life: it
    serves), then the engine, the loader and the fleet worker started, and stopped in reverse."""

    @asynccontextmanager
    async def serving(app: FastAPI) -> AsyncIterator[None]:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        await run_in_threadpool(engine.start)
        try:
            # The loader's reaper and jobs stop, and every lease is freed, before the engine.
            await run_in_threadpool(loader.start)
            await run_in_threadpool(loader.warm)  # a GPU's first-load costs, paid here
            fleet.publish_leases(engine, loader)
            worker = FleetWorker(loader, settings.fleet_worker_config()).start()
            try:
                yield
            finally:
                # Before the loader: a fleet task cut short keeps its claim for the next start.
                await run_in_threadpool(worker.stop)
                await run_in_threadpool(loader.stop)
        finally:
            await run_in_threadpool(engine.stop)

    return serving


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app. The engine starts in the lifespan, not here."""
    settings = settings or get_settings()
    check_bind(settings)
    engine = Engine(settings.engine_config())
    metrics = Metrics()
    loader = Loader(
        engine,
        settings.buffers.loader_config(settings.io.gds_config()),
        observer=metrics.observe_load,
    )
    metrics.watch(engine, loader)

    app = FastAPI(
        title="tierd",
        version=tiering.__version__,
        description="Keeps files on the right storage tier and gets them into GPU memory fast.",
        lifespan=lifespan(settings, engine, loader),
        docs_url=None,  # install_docs serves it from the package, not a CDN
        redoc_url=None,
        dependencies=[Depends(json_bodies)],  # a route's JSON body must come as JSON (415)
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.loader = loader
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(HeadAsGet)  # innermost: the routes see a GET
    app.add_middleware(InflightLimit, limit=settings.max_inflight_requests)
    names = settings.host_names()
    if names is not None:  # a tierd without tokens: safe from web pages (app.browsers)
        own = [settings.own_url()]
        # Outside the in-flight limit (a page's requests take no slot), inside the metrics
        # (its refusals are counted, as route <unmatched>).
        app.add_middleware(BrowserGuard, names=names, port=settings.port, origins=own)
    app.add_middleware(HttpMetrics, metrics=metrics)  # counts 429s too
    app.add_middleware(RequestId)  # every response gets X-Request-ID, 429s and 421s too
    app.add_middleware(AbortedStreams)  # outermost: a body cut by damage ends the request
    QuietAborts.install()
    app.include_router(health.router)
    app.include_router(tiers.router)
    app.include_router(files.router)
    app.include_router(placement.router)
    app.include_router(pins.router)
    app.include_router(policy.router)
    app.include_router(migrations.router)
    app.include_router(loads.router)
    app.include_router(buffers.router)
    app.include_router(jobs.router)
    app.include_router(models.router)
    app.include_router(stats.router)
    app.include_router(history.router)  # its lifespan samples the loader's stats
    app.include_router(heat.router)
    app.include_router(fleet.router)
    app.include_router(fleet_heat.router)
    app.include_router(peer.router)
    app.include_router(metrics_router)
    app.include_router(ui_router)
    install_openapi(app, settings)
    install_docs(app)
    return app
