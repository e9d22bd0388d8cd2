"""Buffer leases: list, show, renew, release.

A lease outlives the deletion of its file: its buffer is the client's (mapped, perhaps in use),
so deleting a file never frees it under the client. The list and a lease's own view say which
of its files were deleted since (``deleted_file_ids``), asked of the catalog each time, so a
deletion by any path (REST, CLI, a scan finding the file gone) shows.
"""

from __future__ import annotations

from fastapi import APIRouter, Response

from app.api.deps import EngineDep, LoaderDep
from app.api.responses import DATA, JSON_BODY, NOT_FOUND
from app.auth import require_data
from app.schemas_loads import BufferList, BufferOut, LeaseOut, RenewRequest, lease_json
from tiering.engine import Engine
from tiering.errors import CatalogUnreachable
from tiering.serving import Lease

router = APIRouter(prefix="/v1/buffers", tags=["buffers"], dependencies=[require_data])


def _existing(engine: Engine, leases: list[Lease]) -> set[int] | None:
    """The ids among the leases' files that still have a record; None while the catalog
    cannot be reached (the list still answers: it is what a degraded host is asked for)."""
    try:
        return engine.catalog.existing_ids(i for lease in leases for i in lease.file_ids)
    except CatalogUnreachable:
        return None


@router.get("", responses=DATA)
def list_buffers(loader: LoaderDep, engine: EngineDep) -> BufferList:
    """Every live lease, oldest first, with the bytes leased and the budget per device."""
    leases = loader.leases.all()
    existing = _existing(engine, leases)
    return BufferList(
        items=[BufferOut.of_lease(lease, existing) for lease in leases],
        leased_bytes=loader.leases.leased_bytes(),
        budget_bytes=loader.leases.budgets(),
        resident_bytes=loader.residency.resident_bytes(),
        kept_bytes=loader.residency.kept_bytes(),
        resident_copies=loader.residency.copies(),
    )


@router.get("/{buffer_id}", responses=DATA | NOT_FOUND)
def get_buffer(buffer_id: str, loader: LoaderDep, engine: EngineDep) -> BufferOut:
    """One lease, with its handle."""
    lease = loader.leases.get(buffer_id)
    return BufferOut.of_lease(lease, _existing(engine, [lease]))


@router.post("/{buffer_id}/renew", response_model=LeaseOut, responses=DATA | NOT_FOUND | JSON_BODY)
async def renew(buffer_id: str, loader: LoaderDep, req: RenewRequest | None = None) -> Response:
    """Restart the lease's TTL (``ttl_s``, default the lease's own)."""
    # On the event loop: a table lookup under a lock held for microseconds, where a trip to the
    # thread pool costs about 100 us of the server's CPU (every live lease renews at a third
    # of its TTL).
    lease = loader.leases.renew(buffer_id, req.ttl_s if req else None)
    return Response(lease_json(lease), media_type="application/json")


@router.delete("/{buffer_id}", response_model=LeaseOut, responses=DATA | NOT_FOUND)
def release(buffer_id: str, loader: LoaderDep) -> Response:
    """Free the buffer now. Clients that still map it keep their mapping until they close it."""
    lease = loader.leases.release(buffer_id)
    return Response(lease_json(lease), media_type="application/json")
