"""I/O statistics of the data path (tiering.io's counters), and their reset."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.api.deps import LoaderDep
from app.api.responses import ADMIN, DATA
from app.auth import require_admin, require_data

router = APIRouter(prefix="/v1/stats", tags=["stats"])


@router.get("", dependencies=[require_data], responses=DATA)
def stats(loader: LoaderDep) -> dict[str, Any]:
    """Bytes, operations, failures, peak and effective GB/s and mean latency of every load,
    in total, ``by_path`` (gds, compat, host, remote, copy), ``by_tier``, ``by_source``
    (where the bytes came from: gpu, peer, memory, page_cache, storage, object_store) and
    ``by_tier_source`` (``"<tier>/<source>"``). A lease handed out from a resident copy
    counts one ``copy`` operation of 0 bytes. ``by_device``: bytes, operations, seconds and
    GB/s of the loads into each device (replicas' peer copies included)."""
    snap: dict[str, Any] = loader.stats().to_dict()
    snap["by_device"] = loader.device_stats.snapshot()
    return snap


@router.post("/reset", dependencies=[require_admin], responses=ADMIN)
def reset(loader: LoaderDep) -> dict[str, Any]:
    """Zero the counters (Prometheus counters at /metrics are never reset)."""
    loader.reset_stats()
    snap: dict[str, Any] = loader.stats().to_dict()
    return snap
