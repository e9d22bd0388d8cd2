"""Settings of the :class:`~tiering.serving.Loader`, and the small types every load shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tiering.io import Device, GdsConfig, IoReport
from tiering.io.fanout import DeliveryMode

__all__ = ["MiB", "FileRef", "LoaderConfig", "Observer"]

MiB = 1 << 20

FileRef = int | str
"""A catalog file id, or a relpath."""

Observer = Callable[[str, Device, IoReport], None]
"""``observer(op, device, report)``: called after every successful read (for metrics)."""


@dataclass(frozen=True)
class LoaderConfig:
    """Settings of the :class:`~tiering.serving.Loader`.

    ``app.settings`` builds it from ``TIERD_BUFFERS__*``.

    Parameters
    ----------
    lease_ttl_s, lease_max_ttl_s:
        Default and longest lifetime of a lease.
    reap_interval_s:
        How often expired leases are freed.
    cpu_budget_bytes:
        Bytes that may be leased in shared memory.
    gpu_budget_fraction:
        Share of a GPU's free memory (when it is first used) that may be leased.
    gpu_budget_bytes:
        A fixed budget per GPU instead of the fraction.
    max_gather_indices:
        Longest index list of a gather (more: TooLarge).
    max_batch_items:
        Most items in one batch load, and most files in one safetensors load or prefetch.
    load_concurrency:
        Items of a batch loaded at once.
    prefetch_concurrency:
        Prefetch jobs running at once; more wait in a queue.
    prefetch_chunk_bytes:
        Granularity of prefetch progress and cancellation.
    job_retention_s:
        How long finished jobs stay visible.
    gpu_cache_bytes, gpu_cache_idle_s:
        Released GPU buffers kept for reuse, per device, and for how long (see
        :class:`~tiering.io.bufferpool.BufferPool`); always within the budget. None (the
        default) keeps up to the budget itself: idle buffers are tierd's own budget, freed
        the moment a new lease needs the room and after ``gpu_cache_idle_s``. A cap below a
        model's shard size would make every reload of that shard pay ``cudaMalloc`` and a
        device-synchronising ``cudaFree`` (on the H100 a 4 GiB memory-tier load fell from
        the pinned copy's 55 GB/s to 47).
    gpu_resident_bytes:
        Resident copies (of ``shared`` loads and GPU prefetches) kept per GPU after their last
        lease, so a restarted client finds them (see :mod:`tiering.serving.residency`): least
        recently used out first, and let go the moment a lease needs the room. None (the
        default) keeps up to the lease budget: like idle buffers, they cost no client
        anything. 0 lets a copy go with its last lease.
    cpu_resident_bytes:
        The same in shared memory (``cpu``). 0 by default: the memory tier is the host's
        cache already.
    gpu_delivery:
        How replicas on several GPUs get their bytes (see :mod:`tiering.io.fanout`):
        ``auto`` measures a peer copy against staging through the host once per pair of GPUs
        and takes the faster; ``peer`` takes peer copies wherever peer access exists;
        ``host`` always stages through pinned host memory.
    io:
        Data-path settings for every device's :class:`~tiering.io.GpuDirectStorage`.
    """

    lease_ttl_s: float = 300.0
    lease_max_ttl_s: float = 3600.0
    reap_interval_s: float = 1.0
    cpu_budget_bytes: int = 4 << 30
    gpu_budget_fraction: float = 0.5
    gpu_budget_bytes: int | None = None
    max_gather_indices: int = 1 << 22
    max_batch_items: int = 1024
    load_concurrency: int = 8
    prefetch_concurrency: int = 2
    prefetch_chunk_bytes: int = 64 * MiB
    job_retention_s: float = 3600.0
    gpu_cache_bytes: int | None = None
    gpu_cache_idle_s: float = 30.0
    gpu_resident_bytes: int | None = None
    cpu_resident_bytes: int = 0
    gpu_delivery: DeliveryMode = "auto"
    io: GdsConfig = field(default_factory=GdsConfig)
