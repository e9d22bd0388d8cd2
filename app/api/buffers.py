"""Buffer leases: list, show, renew, release."""

from __future__ import annotations

from fastapi import APIRouter, Response

from app.api.deps import LoaderDep
from app.api.responses import DATA, JSON_BODY, NOT_FOUND
from app.auth import require_data
from app.schemas_loads import BufferList, LeaseOut, RenewRequest, lease_json

router = APIRouter(prefix="/v1/buffers", tags=["buffers"], dependencies=[require_data])


@router.get("", responses=DATA)
def list_buffers(loader: LoaderDep) -> BufferList:
    """Every live lease, oldest first, with the bytes leased and the budget per device."""
    return BufferList(
        items=[LeaseOut.of(lease) for lease in loader.leases.all()],
        leased_bytes=loader.leases.leased_bytes(),
        budget_bytes=loader.leases.budgets(),
    )


@router.get("/{buffer_id}", responses=DATA | NOT_FOUND)
def get_buffer(buffer_id: str, loader: LoaderDep) -> LeaseOut:
    """One lease, with its handle."""
    return LeaseOut.of(loader.leases.get(buffer_id))


@router.post("/{buffer_id}/renew", response_model=LeaseOut, responses=DATA | NOT_FOUND | JSON_BODY)
def renew(buffer_id: str, loader: LoaderDep, req: RenewRequest | None = None) -> Response:
    """Restart the lease's TTL (``ttl_s``, default the lease's own)."""
    lease = loader.leases.renew(buffer_id, req.ttl_s if req else None)
    return Response(lease_json(lease), media_type="application/json")


@router.delete("/{buffer_id}", response_model=LeaseOut, responses=DATA | NOT_FOUND)
def release(buffer_id: str, loader: LoaderDep) -> Response:
    """Free the buffer now. Clients that still map it keep their mapping until they close it."""
    lease = loader.leases.release(buffer_id)
    return Response(lease_json(lease), media_type="application/json")
