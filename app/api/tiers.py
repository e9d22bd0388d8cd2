"""Tiers, and reconciling them with the catalog on demand."""

from __future__ import annotations

import functools
from typing import Annotated, Any

from fastapi import APIRouter, Query

from app.api.deps import EngineDep
from app.api.responses import ADMIN, BUSY, DATA, INVALID
from app.auth import require_admin, require_data
from app.schemas import TierOut
from tiering.copies import MemoryCache

router = APIRouter(prefix="/v1", tags=["tiers"])


@functools.cache
def gds_host() -> bool:
    """Whether this host has GPUDirect Storage proper (asked once: it loads KvikIO)."""
    from tiering.io import GpuDirectStorage

    return GpuDirectStorage.is_available()


@router.get("/tiers", dependencies=[require_data], responses=DATA | BUSY)
def list_tiers(engine: EngineDep) -> list[TierOut]:
    """Tiers, fastest first, with capacity, use, quota, the catalog's files on each, and whether
    loads from it take the GPUDirect Storage path. A memory tier comes first: its copies'
    bytes and count against its quota (it caches files whose home is a storage tier)."""
    gds = gds_host()
    head = [] if engine.memory is None else [_memory_tier(engine.memory)]
    return head + [TierOut.of(t, gds_host=gds) for t in engine.tier_infos()]


def _memory_tier(memory: MemoryCache) -> TierOut:
    quota = memory.quota_bytes
    entries = memory.entries()
    held = sum(e.size for e in entries)
    used = memory.tier.used_bytes  # copies, fills in flight, and dropped ones a load still holds
    return TierOut(
        name=memory.name,
        rank=memory.tier.rank,
        kind=memory.tier.kind,
        path=memory.tier.location,
        capacity_bytes=quota,
        used_bytes=used,
        free_bytes=max(0, quota - used),
        quota_bytes=quota,
        files=len(entries),
        file_bytes=held,
        stored_bytes=held,
        gds=False,
    )


@router.post("/scan", dependencies=[require_admin], responses=ADMIN | INVALID | BUSY)
def scan(
    engine: EngineDep,
    check: Annotated[bool, Query(description="Only report the drift; change nothing")] = False,
) -> dict[str, Any]:
    """Walk every tier root now and bring the catalog in line with it (what ``tierd scan``
    does while no server runs): adopted, changed, moved, renamed, missing and conflicts."""
    return engine.scan(check=check).as_dict()
