"""Replies of multi-device loads: one buffer per device, and sharded safetensors per rank.

A request that names ``device`` keeps the single-device reply (:class:`~app.schemas_loads.
LeaseOut`, :class:`~app.schemas_loads.SafetensorsOut`); these are the replies of one that
names ``devices``, ``sharding`` or ``rank``.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, Field

from app.schemas_loads import LeaseOut, TensorOut, lease_json
from tiering.serving import DeviceLoaded, LoadTarget, Replica, TensorsLoaded

__all__ = [
    "DeviceTensorsOut",
    "DevicesTensorsOut",
    "ReplicaOut",
    "ReplicasOut",
    "SliceOut",
    "tensors_json",
]

_DELIVERY = Field(
    description="How the device got its bytes: read (from storage, a held copy or the page "
    "cache), split (1/N read from storage by each device at once, the rest by GPU to GPU "
    "copies from the others), peer (GPU to GPU copy from the first device), host (through "
    "pinned host staging)"
)


class ReplicaOut(LeaseOut):
    delivery: str = _DELIVERY


class ReplicasOut(BaseModel):
    buffers: list[ReplicaOut] = Field(description="One per device, in the order named")

    @classmethod
    def of(cls, replicas: list[Replica]) -> ReplicasOut:
        return cls(
            buffers=[
                ReplicaOut(**LeaseOut.of(r.lease).model_dump(), delivery=r.delivery)
                for r in replicas
            ]
        )


class SliceOut(TensorOut):
    full_shape: list[int] | None = Field(
        default=None, description="Shape of the whole tensor (sharded loads)"
    )
    slice_offset: list[int] | None = Field(
        default=None,
        description="Index of the slice's first element in the whole tensor (sharded loads)",
    )


class DeviceTensorsOut(BaseModel):
    device: str
    rank: int | None = Field(description="The rank this device holds; null without sharding")
    delivery: str = _DELIVERY
    buffers: list[LeaseOut] = Field(description="One per shard that had selected tensors")
    tensors: dict[str, SliceOut] = Field(description="shape is the slice's")

    @classmethod
    def of(cls, d: DeviceLoaded) -> DeviceTensorsOut:
        return cls(
            device=str(d.device),
            rank=d.rank,
            delivery=d.delivery,
            buffers=[LeaseOut.of(lease) for lease in d.loaded.leases],
            tensors={
                name: SliceOut(
                    buffer_id=t.buffer_id,
                    offset=t.offset,
                    dtype=t.dtype,
                    shape=list(t.shape),
                    nbytes=t.nbytes,
                    full_shape=None if t.full_shape is None else list(t.full_shape),
                    slice_offset=None if t.slice_offset is None else list(t.slice_offset),
                )
                for name, t in d.loaded.tensors.items()
            },
        )


class DevicesTensorsOut(BaseModel):
    devices: list[DeviceTensorsOut] = Field(description="One per device (per rank, in order)")

    @classmethod
    def of(cls, loads: list[DeviceLoaded]) -> DevicesTensorsOut:
        return cls(devices=[DeviceTensorsOut.of(d) for d in loads])


def safetensors_json(loaded: TensorsLoaded) -> bytes:
    """:class:`SafetensorsOut` as JSON bytes, built directly (as :func:`lease_json`): a
    checkpoint has hundreds of tensors, and a pydantic model per tensor was the larger part
    of a model load's reply on the server (0.6 ms of CPU for 300 tensors)."""
    tensors = {
        name: {
            "buffer_id": t.buffer_id,
            "offset": t.offset,
            "dtype": t.dtype,
            "shape": list(t.shape),
            "nbytes": t.nbytes,
        }
        for name, t in loaded.tensors.items()
    }
    buffers = b",".join(lease_json(lease) for lease in loaded.leases)
    body = json.dumps(tensors, separators=(",", ":")).encode()
    return b'{"buffers":[' + buffers + b'],"tensors":' + body + b"}"


def tensors_json(target: LoadTarget, loads: list[DeviceLoaded]) -> bytes:
    """The reply of a safetensors or model load, as JSON: one entry per device where the
    target named several (or a sharding) (:class:`DevicesTensorsOut`), else the single-device
    reply (:class:`SafetensorsOut`, built directly: it is on an engine's first load's path)."""
    if target.many:
        return DevicesTensorsOut.of(loads).model_dump_json().encode()
    return safetensors_json(loads[0].loaded)
