"""The fleet, as the shared catalog records it, on every host: the hosts with their liveness,
tiers and GPUs, and where a file or a model is among them (what a scheduler asks before it
places a replica).

Both routes only read the catalog: a query for the hosts, and for ``locate`` the records asked
for and their copies (one query per 500 files). Nothing counts as an access.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query

from app.api.deps import EngineDep, LoaderDep
from app.api.responses import BUSY, DATA, INVALID, NOT_FOUND
from app.auth import require_data
from app.errors import HttpError
from app.schemas_fleet import FleetHostOut, FleetHostsOut, LocateOut
from tiering.catalog import Copies, FileRecord
from tiering.catalog.hosts import Hosts
from tiering.engine import Engine
from tiering.fleet import fleet_hosts, locate
from tiering.serving import Loader
from tiering.tiers.paths import MAX_RELPATH_CHARS

router = APIRouter(prefix="/v1/fleet", tags=["fleet"])


def publish_leases(engine: Engine, loader: Loader) -> None:
    """Have this host's heartbeat report the bytes leased on each device (the engine knows
    no leases; the loader's lease table does). Call once both have started."""
    beat = engine.heartbeat
    if beat is None:
        return
    leases = loader.leases

    def devices() -> list[dict[str, Any]]:
        budgets = leases.budgets()
        return [
            {"device": dev, "leased_bytes": n, "budget_bytes": budgets.get(dev)}
            for dev, n in sorted(leases.leased_bytes().items())
        ]

    beat.gpus = devices


def _relpath_query(description: str) -> object:
    # The engine checks a relpath's rules (``invalid_path``, 422); the schema states the
    # length bound it enforces, while pydantic only caps what is read at 4x that.
    return Query(
        max_length=MAX_RELPATH_CHARS * 4,
        description=description,
        json_schema_extra={"minLength": 1, "maxLength": MAX_RELPATH_CHARS},
    )


@router.get("/hosts", dependencies=[require_data], responses=DATA | BUSY)
def hosts(engine: EngineDep) -> FleetHostsOut:
    """Every host registered in the shared catalog, by id: its address, liveness (``down``
    once its heartbeat is older than ``host_timeout_s``; its records stay as they were), its
    tiers with the files and bytes the catalog records there, and its GPUs with leased
    bytes, as its last heartbeat reported them."""
    now = time.time()
    timeout = engine.config.host_timeout_s
    view = fleet_hosts(Hosts(engine.catalog.db), timeout_s=timeout, now=now)
    return FleetHostsOut(
        items=[FleetHostOut.of(h, now) for h in view],
        host_timeout_s=timeout,
        this_host=engine.config.host_id,
    )


@router.get("/locate", dependencies=[require_data], responses=DATA | NOT_FOUND | INVALID | BUSY)
def locate_files(
    engine: EngineDep,
    loader: LoaderDep,
    path: Annotated[str | None, _relpath_query("A file's relpath (not with model)")] = None,
    model: Annotated[
        str | None, _relpath_query("A model's directory relpath (not with path)")
    ] = None,
) -> LocateOut:
    """Every host that has the file at ``path``, or the files of ``model``, and where: a
    cached copy in its memory tier, one of its own tiers, or a shared object store it reads,
    warmest first. ``hosts`` sums it up per host, hosts holding everything first.

    422 for neither or both of ``path`` and ``model``, or a bad relpath; 404 for a file or a
    model the catalog does not have."""
    if (path is None) == (model is None):
        raise HttpError(422, "invalid_query", "give exactly one of path and model")
    records: list[FileRecord]
    if path is not None:
        records = [engine.lookup(path)]
    else:
        assert model is not None
        records = list(loader.models.get(model).files)
    now = time.time()
    db = engine.catalog.db
    located = locate(
        Hosts(db), Copies(db), records, timeout_s=engine.config.host_timeout_s, now=now
    )
    return LocateOut.of(located, path=path, model=model)
