"""Request and response models of loads, buffers, prefetch jobs and stats.

Kept whole past 450 lines: the load family's request and reply models, which share their field
definitions and examples.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from app.api.responses import MAX_ID
from app.schemas import iso
from tiering.io.target import ALL_GPUS, MAX_DEVICES
from tiering.serving import FileRef, Job, Lease, LoadTarget, TensorsLoaded
from tiering.tiers.paths import MAX_RELPATH_CHARS

__all__ = [
    "BatchOut",
    "BatchRequest",
    "BufferList",
    "BufferOut",
    "GatherRequest",
    "JobOut",
    "LeaseOut",
    "LoadRequest",
    "PrefetchRequest",
    "RenewRequest",
    "SHARED_DOC",
    "ShardRuleIn",
    "ShardedTargetIn",
    "ShardingIn",
    "SafetensorsOut",
    "SafetensorsRequest",
    "TargetIn",
    "TensorOut",
    "lease_json",
]

_PATH = Field(default=None, max_length=MAX_RELPATH_CHARS * 4, description="File relpath")
_DEVICE = Field(default="cpu", max_length=32, description="cpu or cuda:N")
_TTL = Field(default=None, gt=0, description="Lease lifetime in seconds; default the server's")


DeviceName = Annotated[str, Field(min_length=1, max_length=32)]
DeviceList = Annotated[list[DeviceName], Field(min_length=1, max_length=MAX_DEVICES)]


class ShardRuleIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pattern: str = Field(min_length=1, max_length=1024, description="fnmatch pattern of names")
    dim: int = Field(ge=0, le=63, description="Dimension to split across the ranks")


class ShardingIn(BaseModel):
    """A tensor-parallel split: the first rule matching a tensor says its dimension."""

    model_config = ConfigDict(extra="forbid")

    world_size: int = Field(ge=1, le=1024, description="Ranks to split across")
    rules: list[ShardRuleIn] = Field(
        default_factory=list,
        max_length=256,
        description="First match wins; a tensor no rule matches is replicated to every rank. "
        "Uneven sizes follow torch.chunk: chunk = ceil(n / world_size), rank k gets "
        "[k*chunk, min(n, (k+1)*chunk)), possibly empty.",
    )
    strict: StrictBool = Field(
        default=False, description="A pattern that matches no tensor is an error (422)"
    )

    def spec(self) -> dict[str, Any]:
        return self.model_dump()


SHARED_DOC = (
    "Read-only contract: the caller promises never to write the buffer (inference weights). "
    "In return, what the load asks for that is already resident on the device (another "
    "shared load's copy of the same file at the same generation, or a gpu prefetch's) is "
    "handed out again: the same allocation (CUDA IPC handle, or shared-memory segment, at an "
    "offset for a range inside a resident one), no read, no new bytes against the lease "
    "budget, source gpu (memory on cpu) and reused true. Otherwise it is read into a new "
    "read-only buffer that stays resident while any lease holds it, and after its last lease "
    "within the device's resident budget (gpu_resident_bytes), until a lease needs the room "
    "or the file changes. The lease and its handle "
    "say read_only: the client makes NumPy views non-writable and marks the CUDA array "
    "interface and DLPack (1.0+) read-only; torch and CuPy cannot refuse writes, which would "
    "change every sharer's bytes. A file that changed is never served from an older copy."
)


class TargetIn(BaseModel):
    """Where a load goes: ``device``, or ``devices``. The handler builds the
    :class:`~tiering.io.target.LoadTarget` once (:meth:`target`) and passes it down."""

    device: str = _DEVICE
    devices: DeviceList | DeviceName | None = Field(
        default=None,
        description=f"Several devices instead of device: cuda:N each, or {ALL_GPUS} (a list "
        "of one, or the string) for every GPU of the host; cpu only alone, and a string names "
        "one device. Storage is read once; the other GPUs get the bytes by peer copy, or "
        "from one pinned host staging buffer where peer access is off. The reply then has "
        "one entry per device (see each one's delivery); a budget overrun on any device is a "
        "507 with nothing leased on the others.",
    )

    @model_validator(mode="after")
    def _device_or_devices(self) -> Any:
        if self.devices is not None and "device" in self.model_fields_set:
            raise ValueError("give device or devices, not both")
        return self

    def target(self) -> LoadTarget:
        """The request's target, parsed (422 for a device or sharding that is wrong)."""
        return LoadTarget.parse(**self._where())

    def _where(self) -> dict[str, Any]:
        return {"device": self.device if self.devices is None else None, "devices": self.devices}


class ShardedTargetIn(TargetIn):
    """A target that may shard safetensors tensors: ``sharding`` and ``rank`` besides."""

    sharding: ShardingIn | None = Field(
        default=None,
        description="Tensor-parallel split: each rank's device gets only its slices (422 for "
        "a pattern that matches nothing when strict, a dimension out of range, a world size "
        "larger than the dimension)",
    )
    rank: int | None = Field(
        default=None,
        ge=0,
        le=1023,
        description="With sharding: load this rank only, into device (or the one of devices); "
        "without it every rank is loaded, devices listing one device per rank",
    )

    shared: StrictBool = Field(
        default=False,
        description="Per shard: a shard whose selected tensors are resident on the device is "
        "handed out again, its allocation and layout as they are. " + SHARED_DOC,
    )
    wait: StrictBool = Field(
        default=True,
        description="false: reply once the copies into one GPU of bytes held in memory (the "
        "memory tier, a resident copy) are queued, before they land, so the client opens its "
        "buffers while they run; each buffer's handle then carries ready_event, which the "
        "client must wait on before it reads (tierd_client does). Other reads, several "
        "devices and shared loads have landed at the reply either way.",
    )

    @model_validator(mode="after")
    def _shared_alone(self) -> Any:
        if self.shared and (self.devices is not None or self.sharding is not None):
            raise ValueError("shared loads take one device and no sharding")
        return self

    def _where(self) -> dict[str, Any]:
        sharding = None if self.sharding is None else self.sharding.spec()
        return {**super()._where(), "sharding": sharding, "rank": self.rank}


def _shared() -> Any:
    return Field(default=False, description=SHARED_DOC)


def _exactly_one(a: str, a_type: str, b: str, b_type: str) -> dict[str, Any]:
    """JSON Schema for "exactly one of ``a`` and ``b`` is given" (a null counts as not given),
    which the models check in their ``_one`` validator."""
    return {
        "oneOf": [
            {"required": [a], "properties": {a: {"type": a_type}}},
            {"required": [b], "properties": {b: {"type": b_type}}},
        ]
    }


class _OneFile(BaseModel):
    model_config = ConfigDict(
        extra="forbid", json_schema_extra=_exactly_one("file_id", "integer", "path", "string")
    )

    file_id: int | None = Field(default=None, ge=1, le=MAX_ID, description="Catalog id of the file")
    path: str | None = _PATH

    @model_validator(mode="after")
    def _one(self) -> Any:
        if (self.file_id is None) == (self.path is None):
            raise ValueError("give exactly one of file_id and path")
        return self

    @property
    def ref(self) -> FileRef:
        return self.file_id if self.file_id is not None else str(self.path)


class LoadRequest(_OneFile, TargetIn):
    offset: int = Field(default=0, ge=0, description="Byte offset in the file")
    length: int | None = Field(default=None, ge=0, description="Bytes; default to the end")
    dtype: str = Field(default="uint8", max_length=32, description="NumPy dtype of the items")
    shape: list[int] | None = Field(
        default=None, max_length=32, description="Shape of the items (one -1 allowed)"
    )
    ttl_s: float | None = _TTL
    shared: StrictBool = _shared()

    @model_validator(mode="after")
    def _shared_alone(self) -> Any:
        if self.devices is not None and self.shared:
            raise ValueError("shared loads take one device")
        return self


class BatchItem(_OneFile):
    offset: int = Field(default=0, ge=0)
    length: int | None = Field(default=None, ge=0)
    device: str | None = Field(default=None, max_length=32, description="Default: the batch's")
    dtype: str = Field(default="uint8", max_length=32)
    shape: list[int] | None = Field(default=None, max_length=32)


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[BatchItem] = Field(description="Ranges to load, concurrently, all or nothing")
    device: str = _DEVICE
    ttl_s: float | None = _TTL
    shared: StrictBool = Field(
        default=False,
        description="For every item (one contract per request, as the batch is all or "
        "nothing); items of one content share one read. " + SHARED_DOC,
    )


class _ManyFiles(BaseModel):
    model_config = ConfigDict(
        extra="forbid", json_schema_extra=_exactly_one("file_ids", "array", "paths", "array")
    )

    file_ids: list[Annotated[int, Field(ge=1, le=MAX_ID)]] | None = Field(
        default=None, description="Files by catalog id"
    )
    paths: list[str] | None = Field(default=None, description="Files by relpath")

    @model_validator(mode="after")
    def _one(self) -> Any:
        if (self.file_ids is None) == (self.paths is None):
            raise ValueError("give exactly one of file_ids and paths")
        return self

    @property
    def refs(self) -> list[FileRef]:
        return list(self.file_ids) if self.file_ids is not None else list(self.paths or [])


class SafetensorsRequest(_ManyFiles, ShardedTargetIn):
    names: list[str] | None = Field(default=None, description="Tensors to load; default all")
    ttl_s: float | None = _TTL


class GatherRequest(_OneFile, TargetIn):
    dim: int = Field(ge=1, description="Items per row")
    dtype: str = Field(default="float32", max_length=32, description="NumPy dtype of the items")
    indices: list[int] | None = Field(default=None, description="Rows, in the order wanted")
    start: int | None = Field(default=None, ge=0, description="First row (with count)")
    count: int | None = Field(default=None, ge=0, description="Rows from start")
    ttl_s: float | None = _TTL


class PrefetchRequest(_ManyFiles):
    target: Literal["gpu", "memory", "nvme", "page_cache"] = Field(
        description="gpu: keep a warm, read-only lease: a resident copy that shared loads are "
        "handed and other loads copy from; memory: copy into the memory tier (422 without "
        "one), kept there ttl_s whatever its heat; nvme: promote to the fastest tier; "
        "page_cache: read through"
    )
    device: str | None = Field(default=None, max_length=32, description="For gpu: cuda:N or cpu")
    ttl_s: float | None = _TTL


class RenewRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttl_s: float | None = _TTL


class LeaseOut(BaseModel):
    buffer_id: str
    kind: str = Field(description="load, gather, safetensors or prefetch")
    file_ids: list[int]
    device: str
    nbytes: int = Field(description="Bytes of data, from handle.offset")
    alloc_bytes: int = Field(description="Bytes of the allocation (what the budget counts)")
    dtype: str
    shape: list[int]
    handle: dict[str, Any] = Field(
        description="cuda_ipc: ipc_handle (base64), offset, alloc_bytes, device_index, "
        "gpu_uuid, and ready_event while the copies of a wait=false load have not landed "
        "(kind cuda_ipc_event, event_handle: a CUDA IPC event handle, base64; device_index, "
        "gpu_uuid): wait on it (cudaIpcOpenEventHandle, cudaEventSynchronize) before reading "
        "the buffer; shm: name, offset, alloc_bytes"
    )
    io_path: str | None = Field(description="gds, compat, host, remote or copy")
    tier: str | None
    seconds: float | None = Field(
        description="Of the read; null for a wait=false load whose copies had not landed"
    )
    gbps: float | None = Field(
        description="GB/s of the read (10**9 bytes per second); null as seconds"
    )
    source: str | None = Field(
        description="Where the bytes came from: gpu (a copy on this GPU; for cpu, on a GPU), "
        "peer (another GPU, or another host of the fleet), memory (host memory), page_cache, "
        "storage (cold) or object_store"
    )
    read_only: bool = Field(
        description="Shared with other leases (shared=true loads, gpu prefetches): never write it"
    )
    reused: bool = Field(
        description="Handed out from a copy already resident: nothing was read (0 bytes)"
    )
    created_at: datetime
    expires_at: datetime
    ttl_s: float

    @classmethod
    def of(cls, lease: Lease) -> LeaseOut:
        r = lease.report
        return cls(
            buffer_id=lease.id,
            kind=lease.kind,
            file_ids=list(lease.file_ids),
            device=str(lease.device),
            nbytes=lease.nbytes,
            alloc_bytes=lease.alloc_bytes,
            dtype=lease.dtype,
            shape=list(lease.shape),
            handle=lease.handle(),
            io_path=r.io_path if r else None,
            tier=r.tier if r else None,
            seconds=round(r.seconds, 9) if r and r.landed else None,
            gbps=round(r.gbps, 3) if r and r.landed else None,
            source=r.source if r else None,
            read_only=lease.read_only,
            reused=lease.reused,
            created_at=iso(lease.created_at),  # type: ignore[arg-type]
            expires_at=iso(lease.expires_at),  # type: ignore[arg-type]
            ttl_s=lease.ttl_s,
        )


def _ts(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def lease_json(lease: Lease) -> bytes:
    """:class:`LeaseOut` as JSON bytes, built directly.

    The load routes are on the 4 KiB-load latency path, where building and re-validating a
    pydantic model costs more than the read; this gives the same document.
    """
    r = lease.report
    doc = {
        "buffer_id": lease.id,
        "kind": lease.kind,
        "file_ids": list(lease.file_ids),
        "device": str(lease.device),
        "nbytes": lease.nbytes,
        "alloc_bytes": lease.alloc_bytes,
        "dtype": lease.dtype,
        "shape": list(lease.shape),
        "handle": lease.handle(),
        "io_path": r.io_path if r else None,
        "tier": r.tier if r else None,
        "seconds": round(r.seconds, 9) if r and r.landed else None,
        "gbps": round(r.gbps, 3) if r and r.landed else None,
        "source": r.source if r else None,
        "read_only": lease.read_only,
        "reused": lease.reused,
        "created_at": _ts(lease.created_at),
        "expires_at": _ts(lease.expires_at),
        "ttl_s": lease.ttl_s,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


class BatchOut(BaseModel):
    buffers: list[LeaseOut] = Field(description="One per item, in request order")


class BufferOut(LeaseOut):
    """A lease as the buffer list shows it: whether its files are still there."""

    deleted_file_ids: list[int] | None = Field(
        description="Those of file_ids deleted since the load. The buffer still holds their "
        "bytes and stays the client's until released or expired (a client may be using it). "
        "null while the catalog cannot be reached"
    )

    @classmethod
    def of_lease(cls, lease: Lease, existing: set[int] | None) -> BufferOut:
        """``existing``: the ids among the lease's files that still have a record (None:
        unknown)."""
        deleted = None if existing is None else [i for i in lease.file_ids if i not in existing]
        return cls(**LeaseOut.of(lease).model_dump(), deleted_file_ids=deleted)


class BufferList(BaseModel):
    items: list[BufferOut]
    leased_bytes: dict[str, int] = Field(description="Allocated bytes leased, per device")
    budget_bytes: dict[str, int] = Field(description="Lease budget, per device used so far")
    resident_bytes: dict[str, int] = Field(
        default_factory=dict,
        description="Allocated bytes of resident copies (read-only buffers of shared loads and "
        "gpu prefetches, handed out again), per device: leased ones and kept ones",
    )
    kept_bytes: dict[str, int] = Field(
        default_factory=dict,
        description="Of resident_bytes, those no lease holds: kept for the next load (not in "
        "leased_bytes), let go least recently used first, or when a lease needs the room",
    )
    resident_copies: dict[str, int] = Field(
        default_factory=dict, description="Resident copies, per device"
    )


class TensorOut(BaseModel):
    buffer_id: str
    offset: int = Field(description="Byte offset of the tensor inside the buffer")
    dtype: str = Field(description="safetensors dtype: F32, BF16, ...")
    shape: list[int]
    nbytes: int


class SafetensorsOut(BaseModel):
    buffers: list[LeaseOut] = Field(description="One per shard that had selected tensors")
    tensors: dict[str, TensorOut]

    @classmethod
    def of(cls, loaded: TensorsLoaded) -> SafetensorsOut:
        return cls(
            buffers=[LeaseOut.of(lease) for lease in loaded.leases],
            tensors={
                name: TensorOut(
                    buffer_id=t.buffer_id,
                    offset=t.offset,
                    dtype=t.dtype,
                    shape=list(t.shape),
                    nbytes=t.nbytes,
                )
                for name, t in loaded.tensors.items()
            },
        )


class JobOut(BaseModel):
    id: str
    kind: str
    target: str
    device: str | None
    state: str = Field(description="queued, running, done, failed or cancelled")
    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int
    progress: float = Field(description="bytes_done / bytes_total (1 when there are no bytes)")
    error: str | None
    errors: list[dict[str, Any]] = Field(description="Files that failed, and why")
    buffer_ids: list[str] = Field(description="Warm leases of a gpu prefetch")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def of(cls, job: Job) -> JobOut:
        with job.lock:
            return cls(
                id=job.id,
                kind=job.kind,
                target=job.target,
                device=job.device,
                state=job.state,
                files_done=job.files_done,
                files_total=job.files_total,
                bytes_done=job.bytes_done,
                bytes_total=job.bytes_total,
                progress=round(job.bytes_done / job.bytes_total, 6) if job.bytes_total else 1.0,
                error=job.error,
                errors=list(job.errors),
                buffer_ids=list(job.lease_ids),
                created_at=iso(job.created_at),  # type: ignore[arg-type]
                started_at=iso(job.started_at),
                finished_at=iso(job.finished_at),
            )
