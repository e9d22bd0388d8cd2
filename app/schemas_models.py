"""Request and response models of the model routes (``/v1/models``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.schemas_loads import ShardedTargetIn
from tiering.catalog import FileRecord
from tiering.io import ModelLayout
from tiering.serving import ModelInfo, ModelSummary
from tiering.tiers.paths import MAX_RELPATH_CHARS

__all__ = [
    "ModelDetail",
    "ModelFileOut",
    "ModelFilesOut",
    "ModelLayoutOut",
    "ModelList",
    "ModelLoadRequest",
    "ModelOut",
    "ModelPrefetchRequest",
]

_TTL = Field(default=None, gt=0, description="Lease lifetime in seconds; default the server's")


class ModelLoadRequest(ShardedTargetIn):
    """What to load of a model, and where to; every field is optional (default: all of it,
    into ``cpu``). ``device``, ``devices``, ``sharding``, ``rank`` and ``shared`` as for
    ``POST /v1/load/safetensors``."""

    model_config = ConfigDict(extra="forbid")

    names: list[str] | None = Field(
        default=None, description="Tensors to load (not with prefix); default all"
    )
    prefix: str | None = Field(
        default=None,
        max_length=MAX_RELPATH_CHARS,
        description="Load the tensors whose names start with this (not with names)",
    )
    ttl_s: float | None = _TTL


class ModelPrefetchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: Literal["gpu", "memory", "nvme", "page_cache"] = Field(
        description="gpu: keep warm leases; memory: copy every file into the memory tier (422 "
        "without one); nvme: promote every file to the fastest tier; page_cache: read every "
        "file through"
    )
    device: str | None = Field(default=None, max_length=32, description="For gpu: cuda:N or cpu")
    ttl_s: float | None = _TTL


class ModelOut(BaseModel):
    """A model as the list shows it: its files' totals, and the tiers and heat of its weights."""

    name: str = Field(description="The model's directory (a relpath)")
    file_count: int = Field(description="Files directly in the directory")
    total_bytes: int
    weight_files: int = Field(description="*.safetensors files among them")
    weight_bytes: int
    tiers: dict[str, int] = Field(description="Bytes of weights per tier, fastest first")
    heat_max: float = Field(description="Heat of the hottest weights file: what policy moves by")
    heat_sum: float = Field(description="Heat of all weights files together")
    pinned_tier: str | None = Field(description="The tier every file is pinned to, if one")
    pinned_files: int = Field(description="Files with a pin")
    has_index: bool = Field(description="Whether a *.safetensors.index.json is there")

    @classmethod
    def of(cls, s: ModelSummary) -> ModelOut:
        return cls(
            name=s.name,
            file_count=s.files,
            total_bytes=s.total_bytes,
            weight_files=s.weight_files,
            weight_bytes=s.weight_bytes,
            tiers=s.tiers,
            heat_max=round(s.heat_max, 6),
            heat_sum=round(s.heat_sum, 6),
            pinned_tier=s.pinned_tier,
            pinned_files=s.pinned_files,
            has_index=s.has_index,
        )


class ModelList(BaseModel):
    items: list[ModelOut]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null at end")


class ModelFileOut(BaseModel):
    id: int
    path: str
    name: str = Field(description="File name inside the model's directory")
    role: str = Field(description="weights, index or other (config, tokenizer, ...)")
    size: int
    tier: str
    heat: float
    state: str
    pinned_tier: str | None

    @classmethod
    def of(cls, info: ModelInfo, rec: FileRecord, heat: float) -> ModelFileOut:
        return cls(
            id=rec.id,
            path=rec.relpath,
            name=info.file_name(rec),
            role=info.role(rec),
            size=rec.size,
            tier=rec.tier,
            heat=round(heat, 6),
            state=rec.state,
            pinned_tier=rec.pinned_tier,
        )


class ModelFilesOut(ModelOut):
    files: list[ModelFileOut] = Field(description="Files directly in the directory, by name")

    @classmethod
    def build(
        cls, info: ModelInfo, s: ModelSummary, heat: Callable[[FileRecord], float]
    ) -> ModelFilesOut:
        return cls(
            **ModelOut.of(s).model_dump(),
            files=[ModelFileOut.of(info, r, heat(r)) for r in info.files],
        )


class ModelLayoutOut(BaseModel):
    shards: list[str] = Field(description="The weights files a load reads, in load order")
    index_file: str | None = Field(description="The index the shards come from, if any")
    tensors: int | None = Field(description="Tensors the index names (null without an index)")


class ModelDetail(ModelFilesOut):
    layout: ModelLayoutOut

    @classmethod
    def detail(
        cls,
        info: ModelInfo,
        s: ModelSummary,
        lay: ModelLayout,
        heat: Callable[[FileRecord], float],
    ) -> ModelDetail:
        return cls(
            **ModelFilesOut.build(info, s, heat).model_dump(),
            layout=ModelLayoutOut(
                shards=list(lay.shards), index_file=lay.index_file, tensors=lay.tensor_count
            ),
        )
