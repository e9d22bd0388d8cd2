"""The fleet, as the shared catalog records it, on every host: the hosts with their liveness,
tiers and GPUs, and where a file or a model is among them (what a scheduler asks before it
places a replica); and fleet jobs, a prefetch with one task per host that each host's
:class:`~tiering.serving.fleetjobs.FleetWorker` claims and runs.

``hosts`` and ``locate`` only read the catalog: a query for the hosts, and for ``locate`` the
records asked for and their copies (one query per 500 files). Nothing counts as an access.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from fastapi.responses import JSONResponse

from app.api.deps import EngineDep, LoaderDep
from app.api.responses import BUSY, DATA, INVALID, JSON_BODY, MAX_ID, NOT_FOUND, TOO_LARGE
from app.auth import require_data
from app.errors import HttpError
from app.schemas_fleet import (
    FleetHostOut,
    FleetHostsOut,
    FleetJobOut,
    FleetJobsOut,
    FleetPrefetchRequest,
    LocateOut,
)
from tiering.catalog import Copies, FileRecord, FileState
from tiering.catalog.hosts import Hosts
from tiering.engine import Engine
from tiering.errors import TooLarge
from tiering.fleet import fleet_hosts, locate
from tiering.fleet.jobs import FleetJobs
from tiering.fleet.jobstate import JobFile
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


#: ``?path=`` or ``?model=`` of the fleet's read routes (exactly one: see asked_records).
PathParam = Annotated[str | None, _relpath_query("A file's relpath (not with model)")]
ModelParam = Annotated[str | None, _relpath_query("A model's directory relpath (not with path)")]


def asked_records(
    engine: Engine, loader: Loader, path: str | None, model: str | None
) -> list[FileRecord]:
    """The record at ``path``, or the files of ``model``: 422 for neither or both, or a bad
    relpath; 404 for a file or a model the catalog does not have."""
    if (path is None) == (model is None):
        raise HttpError(422, "invalid_query", "give exactly one of path and model")
    if path is not None:
        return [engine.lookup(path)]
    assert model is not None
    return list(loader.models.get(model).files)


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
    path: PathParam = None,
    model: ModelParam = None,
) -> LocateOut:
    """Every host that has the file at ``path``, or the files of ``model``, and where: a
    cached copy in its memory tier, one of its own tiers, or a shared object store it reads,
    warmest first. ``hosts`` sums it up per host, hosts holding everything first.

    422 for neither or both of ``path`` and ``model``, or a bad relpath; 404 for a file or a
    model the catalog does not have."""
    records = asked_records(engine, loader, path, model)
    now = time.time()
    db = engine.catalog.db
    located = locate(
        Hosts(db), Copies(db), records, timeout_s=engine.config.host_timeout_s, now=now
    )
    return LocateOut.of(located, path=path, model=model)


# -- fleet jobs ----------------------------------------------------------------------------------

JobId = Annotated[int, Path(ge=1, le=MAX_ID, description="Fleet job id")]


def _jobs(engine: Engine) -> FleetJobs:
    return FleetJobs(engine.catalog.db, host=engine.config.host_id)


def _hosts_up_now(engine: Engine, asked: list[str] | str) -> list[str]:
    """The hosts a job goes to: every host up now for "all", else those asked for, each of
    which must be registered and up (422 naming the others)."""
    view = fleet_hosts(Hosts(engine.catalog.db), timeout_s=engine.config.host_timeout_s)
    state = {h.host_id: h for h in view}
    if asked == "all":
        up = [h.host_id for h in view if h.state == "up"]
        if not up:
            raise HttpError(422, "no_host_up", "no host of the fleet is up now")
        return up
    wanted = list(dict.fromkeys(asked))  # in order, once each
    unknown = [h for h in wanted if h not in state]
    if unknown:
        raise HttpError(
            422, "unknown_host", f"no host registered as {', '.join(map(repr, unknown))}"
        )
    down = [state[h] for h in wanted if state[h].state != "up"]
    if down:
        now = time.time()
        said = ", ".join(
            f"{h.host_id} (no heartbeat for {now - h.last_heartbeat:.0f} s)" for h in down
        )
        raise HttpError(
            422,
            "host_down",
            f"down now, past host_timeout_s={engine.config.host_timeout_s:g}: {said}",
        )
    return wanted


@router.post(
    "/prefetch",
    status_code=202,
    dependencies=[require_data],
    responses=DATA | NOT_FOUND | JSON_BODY | TOO_LARGE | BUSY,
)
def fleet_prefetch(req: FleetPrefetchRequest, engine: EngineDep, loader: LoaderDep) -> JSONResponse:
    """Warm a model or files up on several hosts: one fleet job with a task per host, which
    each host's tierd claims from the shared catalog and runs as a local prefetch (target as
    for ``POST /v1/prefetch``). Returns the job at once; follow it at
    ``GET /v1/fleet/jobs/{id}``, per host and in total.

    ``hosts`` defaults to every host up now. 422 for neither or both of ``model`` and
    ``paths``, a bad relpath, ``device`` without target gpu, a host id not registered, or a
    host that is down (named); 404 for a file or model the catalog does not have; 413 for
    more files than a prefetch takes. Nothing is recorded on any error.
    """
    records: list[FileRecord]
    if req.model is not None:
        info = loader.models.get(req.model)
        records = [r for r in info.files if r.state != FileState.MISSING]
    else:
        records = [engine.lookup(p) for p in req.paths or []]
    files = list({r.id: JobFile(r.id, r.relpath, r.size) for r in records}.values())
    limit = loader.config.max_batch_items
    if len(files) > limit:
        raise TooLarge(f"{len(files)} files is over the limit of {limit}", limit=limit)
    hosts = _hosts_up_now(engine, req.hosts)
    job = _jobs(engine).create(
        target=req.target, files=files, hosts=hosts, model=req.model, device=req.device
    )
    return JSONResponse(
        FleetJobOut.of(job).model_dump(mode="json"),
        status_code=202,
        headers={"Location": f"/v1/fleet/jobs/{job.id}"},
    )


@router.get("/jobs", dependencies=[require_data], responses=DATA | INVALID | BUSY)
def list_fleet_jobs(
    engine: EngineDep,
    limit: Annotated[int, Query(ge=1, le=100, description="Jobs per page")] = 20,
    cursor: Annotated[
        int | None, Query(ge=1, le=MAX_ID, description="next_cursor of the previous page")
    ] = None,
) -> FleetJobsOut:
    """Fleet jobs, newest first, a page at a time, each with its hosts' tasks."""
    jobs = _jobs(engine).page(limit=limit + 1, before=cursor)
    more = len(jobs) > limit
    jobs = jobs[:limit]
    return FleetJobsOut(
        items=[FleetJobOut.of(j) for j in jobs], next_cursor=jobs[-1].id if more else None
    )


@router.get(
    "/jobs/{job_id}", dependencies=[require_data], responses=DATA | NOT_FOUND | INVALID | BUSY
)
def get_fleet_job(job_id: JobId, engine: EngineDep) -> FleetJobOut:
    """A fleet job: its state, each host's task (state, attempts, claim, files and bytes
    done of the total, why it failed, files that failed) and the totals over the hosts."""
    return FleetJobOut.of(_jobs(engine).get(job_id))


@router.delete(
    "/jobs/{job_id}", dependencies=[require_data], responses=DATA | NOT_FOUND | INVALID | BUSY
)
def cancel_fleet_job(job_id: JobId, engine: EngineDep) -> FleetJobOut:
    """Cancel every task not finished: a host running one stops at its next progress write
    (within a second). Tasks already finished, and a finished job, are left as they are."""
    return FleetJobOut.of(_jobs(engine).cancel(job_id))
