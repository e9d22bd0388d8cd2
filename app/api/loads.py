"""Loads: files, byte ranges, safetensors shards and matrix rows into leased buffers."""

from __future__ import annotations

import time
from collections.abc import Mapping

from fastapi import APIRouter, Response
from pydantic import BaseModel

from app.api.deps import LoaderDep
from app.api.responses import BUSY, DATA, JSON_BODY, NO_SPACE, NOT_FOUND, RANGE, TOO_LARGE
from app.auth import require_data
from app.schemas_devices import DevicesTensorsOut, ReplicasOut, tensors_json
from app.schemas_loads import (
    BatchOut,
    BatchRequest,
    GatherRequest,
    LeaseOut,
    LoadRequest,
    SafetensorsOut,
    SafetensorsRequest,
    lease_json,
)
from tiering.serving import Lease, LoadItem

router = APIRouter(prefix="/v1", tags=["loads"], dependencies=[require_data])

LOAD_ERRORS = DATA | NOT_FOUND | RANGE | TOO_LARGE | JSON_BODY | BUSY | NO_SPACE


def _lease(lease: Lease) -> Response:
    return Response(lease_json(lease), media_type="application/json")


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


@router.post("/load", response_model=LeaseOut | ReplicasOut, responses=LOAD_ERRORS)
def load(req: LoadRequest, loader: LoaderDep) -> Response:
    """A file or byte range into a new buffer on ``cuda:N`` or ``cpu``; counts one access.

    416 for a range outside the file; 422 for an unknown device, a dtype that does not divide
    the length or a shape that does not match; 507 over the device's lease budget.
    ``shared``: a read-only lease, handed out from a resident copy where there is one.
    ``devices``: the same bytes on several GPUs, one buffer each (ReplicasOut).

    The ``Server-Timing`` header says where the time went (ms): ``load`` in all, of which
    ``io`` (the read itself), then ``reply`` (building this body).
    """
    target = req.target()
    t0 = time.perf_counter()
    replicas = loader.load(
        req.ref,
        offset=req.offset,
        length=req.length,
        device=target,
        dtype=req.dtype,
        shape=req.shape,
        ttl_s=req.ttl_s,
        shared=req.shared,
    )
    t1 = time.perf_counter()
    body: str | bytes
    if target.many:
        body = ReplicasOut.of(replicas).model_dump_json()
    else:
        body = lease_json(replicas[0].lease)
    phases = {"load": t1 - t0}
    report = replicas[0].lease.report
    if report is not None and report.landed:
        phases["io"] = report.seconds
    phases["reply"] = time.perf_counter() - t1
    return Response(
        body, media_type="application/json", headers={"Server-Timing": server_timing(phases)}
    )


@router.post("/load/batch", responses=LOAD_ERRORS)
def load_batch(req: BatchRequest, loader: LoaderDep) -> BatchOut:
    """Many ranges at once: all are checked and budgeted first, then read concurrently."""
    items = [
        LoadItem(
            file=it.ref,
            offset=it.offset,
            length=it.length,
            dtype=it.dtype,
            shape=it.shape,
            device=it.device,
        )
        for it in req.items
    ]
    leases = loader.load_batch(items, device=req.device, ttl_s=req.ttl_s, shared=req.shared)
    return BatchOut(buffers=[LeaseOut.of(lease) for lease in leases])


@router.post(
    "/load/safetensors", response_model=SafetensorsOut | DevicesTensorsOut, responses=LOAD_ERRORS
)
def load_safetensors(req: SafetensorsRequest, loader: LoaderDep) -> Response:
    """safetensors shards into one buffer each; ``tensors`` says where each tensor lies.

    The ``Server-Timing`` header says where the time went (ms): ``load`` in all, of which
    ``open``, ``read`` (with ``alloc``), ``sync`` and ``grant`` for a one-device load, then
    ``reply`` (building this body).

    ``devices``, ``sharding`` or ``rank``: one entry per device (DevicesTensorsOut): every
    tensor on every device, or each rank's slices on its device. 422 for a bad sharding spec,
    a rank out of range, an unknown device or cpu among several; 507 over any device's budget
    (nothing is left leased on the others).
    """
    target = req.target()
    t0 = time.perf_counter()
    loads = loader.load_safetensors(
        req.refs,
        names=req.names,
        device=target,
        ttl_s=req.ttl_s,
        shared=req.shared,
        wait=req.wait,
    )
    t1 = time.perf_counter()
    body = tensors_json(target, loads)
    phases = {**loads[0].loaded.timings, "load": t1 - t0, "reply": time.perf_counter() - t1}
    return Response(
        body, media_type="application/json", headers={"Server-Timing": server_timing(phases)}
    )


def server_timing(phases: Mapping[str, float]) -> str:
    """A ``Server-Timing`` header (milliseconds) of ``{phase: seconds}``: where a load's time
    went on the server, for ``tierd bench models``' profile and a browser's network panel."""
    return ", ".join(f"{name};dur={s * 1e3:.3f}" for name, s in phases.items())


@router.post("/vectors/gather", response_model=LeaseOut | ReplicasOut, responses=LOAD_ERRORS)
def gather(req: GatherRequest, loader: LoaderDep) -> Response:
    """Rows of a row-major matrix file, by index list or by ``start`` and ``count``.

    413 for an index list over ``buffers.max_gather_indices``; 422 for an index outside the
    matrix or a ``dim``/``dtype`` that does not divide the file. ``devices``: the rows on
    several GPUs, one buffer each (ReplicasOut).
    """
    target = req.target()
    replicas = loader.gather(
        req.ref,
        dim=req.dim,
        dtype=req.dtype,
        indices=req.indices,
        start=req.start,
        count=req.count,
        device=target,
        ttl_s=req.ttl_s,
    )
    return _json(ReplicasOut.of(replicas)) if target.many else _lease(replicas[0].lease)
