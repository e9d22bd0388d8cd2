"""The settings of loads: leased buffers and their budgets (``buffers``), and the engines that
read local files and object-store tiers by URL (``io``). Part of :class:`app.settings.Settings`,
whose module keeps the rest; the names of the environment variables are unchanged
(``TIERD_BUFFERS__*``, ``TIERD_IO__*``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tiering.io import BackendName, GdsConfig
from tiering.serving import LoaderConfig

__all__ = ["BufferSettings", "IoSettings"]


class BufferSettings(BaseModel):
    """Loads over REST: leased buffers, their budgets, limits and prefetch jobs."""

    ttl_s: float = Field(default=300.0, gt=0, description="Default lifetime of a buffer lease")
    max_ttl_s: float = Field(default=3600.0, gt=0, description="Longest lease a client may ask for")
    reap_interval_s: float = Field(
        default=1.0, gt=0, description="How often expired leases are freed"
    )
    cpu_budget_bytes: int = Field(
        default=4 << 30, ge=0, description="Bytes that may be leased in shared memory (cpu)"
    )
    gpu_budget_fraction: float = Field(
        default=0.5, gt=0, le=1, description="Share of a GPU's free memory that may be leased"
    )
    gpu_budget_bytes: int | None = Field(
        default=None, ge=0, description="Fixed lease budget per GPU instead of the fraction"
    )
    max_gather_indices: int = Field(
        default=1 << 22, ge=1, description="Longest index list of a gather; more gets 413"
    )
    max_batch_items: int = Field(
        default=1024,
        ge=1,
        description="Most items (or files) in one batch, safetensors or prefetch",
    )
    load_concurrency: int = Field(default=8, ge=1, description="Items of a batch loaded at once")
    prefetch_concurrency: int = Field(
        default=2, ge=1, description="Prefetch jobs running at once; more wait in a queue"
    )
    prefetch_chunk_bytes: int = Field(
        default=64 << 20, ge=4096, description="Step of prefetch progress and cancellation"
    )
    job_retention_s: float = Field(
        default=3600.0, gt=0, description="How long finished jobs stay visible"
    )
    gpu_cache_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Released GPU buffers kept for reuse, per device (unset: up to the budget)",
    )
    gpu_cache_idle_s: float = Field(
        default=30.0, ge=0, description="How long a released GPU buffer is kept for reuse"
    )
    gpu_resident_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Resident copies (shared loads, gpu prefetches) kept per GPU after their "
        "last lease, least recently used out first (unset: up to the budget; 0: none)",
    )
    cpu_resident_bytes: int = Field(
        default=0, ge=0, description="The same in shared memory (cpu); 0: none"
    )

    gpu_delivery: Literal["auto", "peer", "host"] = Field(
        default="auto",
        description="How replicas on several GPUs get their bytes: auto (measure peer copies "
        "against staging through the host, once per pair of GPUs), peer, or host",
    )

    def loader_config(self, io: GdsConfig | None = None) -> LoaderConfig:
        return LoaderConfig(
            io=io or GdsConfig(),
            lease_ttl_s=self.ttl_s,
            lease_max_ttl_s=self.max_ttl_s,
            reap_interval_s=self.reap_interval_s,
            cpu_budget_bytes=self.cpu_budget_bytes,
            gpu_budget_fraction=self.gpu_budget_fraction,
            gpu_budget_bytes=self.gpu_budget_bytes,
            max_gather_indices=self.max_gather_indices,
            max_batch_items=self.max_batch_items,
            load_concurrency=self.load_concurrency,
            prefetch_concurrency=self.prefetch_concurrency,
            prefetch_chunk_bytes=self.prefetch_chunk_bytes,
            job_retention_s=self.job_retention_s,
            gpu_cache_bytes=self.gpu_cache_bytes,
            gpu_cache_idle_s=self.gpu_cache_idle_s,
            gpu_resident_bytes=self.gpu_resident_bytes,
            cpu_resident_bytes=self.cpu_resident_bytes,
            gpu_delivery=self.gpu_delivery,
        )


class IoSettings(BaseModel):
    """The engines of loads: local files, object-store tiers by URL (``GdsConfig``)."""

    backend: BackendName = Field(default=GdsConfig.backend, description="Local files' engine")
    remote_backend: Literal["auto", "sockets", "kvikio", "python"] = Field(
        default=GdsConfig.remote_backend,
        description="auto: tierd's own connections for a fast plain-http origin (judged by one "
        "GET alone), else KvikIO where installed, else tierd's connections or the tier's GETs; "
        "sockets, kvikio or python: that engine",
    )
    remote_url_threads: int = Field(
        default=GdsConfig.remote_url_threads,
        ge=1,
        le=1024,
        description="Connections of a load by URL (S3 gives about 90 MB/s a connection)",
    )
    remote_url_task_size: int = Field(
        default=GdsConfig.remote_url_task_size,
        ge=64 << 10,
        le=1 << 30,
        description="Bytes per ranged GET of a load by URL (twice this from a fast origin)",
    )

    def gds_config(self) -> GdsConfig:
        return GdsConfig(
            backend=self.backend,
            remote_backend=self.remote_backend,
            remote_url_threads=self.remote_url_threads,
            remote_url_task_size=self.remote_url_task_size,
        )
