"""Prefetch jobs: start, follow, cancel."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.api.deps import LoaderDep
from app.api.responses import BUSY, DATA, JSON_BODY, NO_SPACE, NOT_FOUND, RANGE, TOO_LARGE
from app.auth import require_data
from app.schemas_loads import JobOut, PrefetchRequest

router = APIRouter(prefix="/v1", tags=["jobs"], dependencies=[require_data])


@router.post(
    "/prefetch",
    status_code=202,
    responses=DATA | NOT_FOUND | RANGE | TOO_LARGE | JSON_BODY | BUSY | NO_SPACE,
)
def prefetch(req: PrefetchRequest, loader: LoaderDep) -> JSONResponse:
    """Start warming files up (``gpu``, ``memory``, ``nvme`` or ``page_cache``); returns the
    job at once.

    Unknown files are 404 before anything starts. Follow it at ``GET /v1/jobs/{id}``.
    """
    job = loader.prefetch(req.refs, target=req.target, device=req.device, ttl_s=req.ttl_s)
    return JSONResponse(
        JobOut.of(job).model_dump(mode="json"),
        status_code=202,
        headers={"Location": f"/v1/jobs/{job.id}"},
    )


@router.get("/jobs", responses=DATA)
def list_jobs(loader: LoaderDep) -> list[JobOut]:
    """Every job still kept (finished ones for ``buffers.job_retention_s``)."""
    return [JobOut.of(job) for job in loader.jobs.all()]


@router.get("/jobs/{job_id}", responses=DATA | NOT_FOUND)
def get_job(job_id: str, loader: LoaderDep) -> JobOut:
    """State and progress: files and bytes done of the total."""
    return JobOut.of(loader.jobs.get(job_id))


@router.delete("/jobs/{job_id}", responses=DATA | NOT_FOUND)
def cancel_job(job_id: str, loader: LoaderDep) -> JobOut:
    """Cancel: a queued job never starts, a running one stops at its next step (a gpu job's
    warm leases are released). A finished job is returned unchanged."""
    return JobOut.of(loader.jobs.cancel(job_id))
