"""Settings of the data path: :class:`GdsConfig` and the per-tier :class:`TierIo`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from tiering.errors import InvalidInput

__all__ = ["BackendName", "GdsConfig", "RemoteBackendName", "TierIo"]

MiB = 1 << 20

BackendName = Literal["auto", "gds", "kvikio", "host"]
"""Which I/O engine to use.

``auto`` picks the best one installed and logs why it fell back; ``gds`` requires KvikIO *and* a
working cuFile + nvidia-fs; ``kvikio`` requires KvikIO (GDS where the host has it, its POSIX
compat path otherwise); ``host`` is tierd's own parallel ``preadv`` into host memory.
"""

_BACKENDS = ("auto", "gds", "kvikio", "host")

RemoteBackendName = Literal["auto", "sockets", "kvikio", "python"]
"""Which engine reads remote files (object-store tiers) that can be read by presigned URL, in
calls of at least ``remote_url_min_bytes`` (smaller ones always take tierd's ranged GETs).

``auto``: tierd's own HTTP connections (:mod:`tiering.ranges._http`) where the URL is plain
``http://`` with no proxy and the origin is a fast one (one GET alone, sent once, moved
:data:`~tiering.ranges._http.FAST_BPS` or more), in GETs of twice the task size on half the
connections; else KvikIO's ``RemoteFile`` (libcurl on its C++ thread pool) where KvikIO is
installed with remote I/O; else tierd's connections in GETs of the task size (plain http); else
tierd's ranged GETs through the tier's S3 client, which also read any range the others could
not. ``sockets``: tierd's connections in GETs of the task size where the URL allows, never
KvikIO. Their bodies are received straight into the destination (host memory, or a pinned
piece on its way to the GPU) with ``If-Match`` on every GET, for about 0.6x KvikIO's CPU. On the
H100 machine, 1 GiB into cuda: at 64 x 16 MiB from nginx on loopback 1.04-1.10x KvikIO (128 x
8 MiB); at 128 x 8 MiB from nginx paced at 100 MB/s a connection by tc 0.70x, which is why a
paced origin stays with KvikIO. ``kvikio``: KvikIO for every read of such a file (an error
where it cannot run). ``python``: always tierd's ranged GETs.
"""

_REMOTE_BACKENDS = ("auto", "sockets", "kvikio", "python")


@dataclass(frozen=True)
class TierIo:
    """How reads from one tier are issued.

    Parameters
    ----------
    threads:
        Concurrent reads in flight for one load. KvikIO's default of 1 thread reaches a sixth
        of what the H100 machine can do from the page cache, so tierd never uses it.
    task_size:
        Bytes per read request. 4-8 MiB measured best for hot files; a slow disk wants fewer,
        larger requests.
    direct:
        ``True``: use the GDS direct path when the host has it; ``False``: always the
        bounce-buffer path; ``None`` (default): direct for the fastest tier only.
    """

    threads: int = 16
    task_size: int = 4 * MiB
    direct: bool | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.threads <= 256:
            raise InvalidInput(f"threads must be in 1..256, got {self.threads}")
        if self.task_size < 4096 or self.task_size % 4096:
            raise InvalidInput(
                f"task_size must be a positive multiple of 4096, got {self.task_size}"
            )


def _default_tier_io() -> Mapping[str, TierIo]:
    return MappingProxyType({})


@dataclass(frozen=True)
class GdsConfig:
    """Configuration of :class:`~tiering.io.GpuDirectStorage`.

    The first five fields follow the seed API; the rest are tierd's tuning knobs. Defaults are
    the best settings measured on the H100 machine (see ``shared/device/README.md``).

    Parameters
    ----------
    enabled:
        Allow the GDS direct path (cuFile + nvidia-fs). ``False`` keeps every GPU read on the
        bounce-buffer path, which is also what hosts without nvidia-fs get.
    max_concurrent_ops:
        Files or shards loaded at once by the batch calls.
    alignment:
        Alignment in bytes that direct I/O needs (4096 for O_DIRECT and cuFile).
    prefetch_batch_size:
        Rows of a gather are staged in batches of at most this many bytes.
    thread_pool_size:
        Threads that run the ``async`` twins of the blocking calls.
    require_alignment:
        Enforce ``alignment`` on offsets, lengths and buffer addresses of ``load_to_gpu``
        (O_DIRECT semantics) instead of splitting unaligned requests silently.
    backend:
        See :data:`BackendName`.
    fast_tier_io:
        Settings for the fastest tier (rank 0) and for files outside every tier. 16 threads
        x 8 MiB measured best for hot 4 GiB loads on the H100 machine (48.7 GB/s).
    slow_tier_io:
        Settings for every slower tier.
    cold_io:
        Settings used when most of the requested range is not in the page cache. On the
        H100 machine's virtio disk 8 threads x 4 MiB measured best (1.72 GB/s; 1 x 16 MiB:
        1.26, 16 x 4 MiB KvikIO: 1.6-2.1 in the device README).
    tier_io:
        Per tier name overrides of the two defaults above.
    gather_threads:
        Threads that copy scattered rows into the staging buffer.
    cold_threshold:
        Fraction of the range resident in the page cache below which ``cold_io`` is used.
    remote_threads:
        Ranges of remote files (object-store tiers) read at once by one storage: tensors of a
        shard, row ranges of a gather, staging pieces of a GPU load. Each range may fan out
        further on its tier's own connections (the tier's ``connections``).
    remote_piece_size:
        Bytes of one pinned staging piece of a remote load into GPU memory.
    remote_pieces:
        Staging pieces per remote GPU load: while one piece is copied to the device, the
        others are being fetched (2 is double buffering).
    remote_stagings:
        Remote GPU loads that may hold staging at once (each holds ``remote_pieces`` pieces
        of pinned memory); more wait for one to finish.
    remote_backend:
        See :data:`RemoteBackendName`.
    remote_url_threads:
        Connections of a read by URL: tierd's HTTP pool has this many threads, and KvikIO's
        thread pool (one per process) is grown to at least this many before the first KvikIO
        remote read: one thread is one HTTP connection in flight. S3 gives
        about 90 MB/s a connection, so filling a GPU host's 100-400 Gbit/s takes 128 or more
        of them; against an S3-like origin (100 MB/s per connection) on the H100 machine 64
        x 8 MiB reached 7.3 GB/s and KvikIO's default of 16 a quarter of that.
    remote_url_task_size:
        Bytes per ranged GET of a read by URL (twice this from a fast origin by tierd's
        connections). These keep at most one pinned piece of twice this a connection for reads
        into GPU memory, shared by their threads (128 x 16 MiB; KvikIO's bounce buffers are
        16 MiB a task in flight). KvikIO's ``task_size`` is one per process: it is raised to at
        least this (tierd's local reads pass their own).
    remote_url_min_bytes:
        Calls that move fewer bytes use the tier's own ranged GETs: a read by URL costs a
        presigned URL at the file's first read (and, through KvikIO, a HEAD after it).
    remote_url_expires_s:
        Lifetime of the presigned GET URL a read by URL uses; an open file presigns a new
        one when half of it has passed.
    gpu_decode:
        Compressed files loaded into GPU memory cross PCIe as their stored bytes and are
        decoded there by nvCOMP (:mod:`tiering.io._decode_gpu`), where it is installed.
        False decodes them on the host and copies the logical bytes (the bench compares).
    """

    enabled: bool = True
    max_concurrent_ops: int = 32
    alignment: int = 4096
    prefetch_batch_size: int = 64 * MiB
    thread_pool_size: int = 4
    require_alignment: bool = False
    backend: BackendName = "auto"
    fast_tier_io: TierIo = TierIo(threads=16, task_size=8 * MiB)
    slow_tier_io: TierIo = TierIo(threads=4, task_size=16 * MiB, direct=False)
    cold_io: TierIo = TierIo(threads=8, task_size=4 * MiB)
    tier_io: Mapping[str, TierIo] = field(default_factory=_default_tier_io)
    gather_threads: int = 16
    cold_threshold: float = 0.5
    remote_threads: int = 16
    remote_piece_size: int = 64 * MiB
    remote_pieces: int = 8
    remote_stagings: int = 2
    remote_backend: RemoteBackendName = "auto"
    remote_url_threads: int = 128
    remote_url_task_size: int = 8 * MiB
    remote_url_min_bytes: int = 16 * MiB
    remote_url_expires_s: int = 3600
    gpu_decode: bool = True

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise InvalidInput(f"backend must be one of {_BACKENDS}, got {self.backend!r}")
        for name in (
            "max_concurrent_ops",
            "thread_pool_size",
            "gather_threads",
            "remote_threads",
            "remote_stagings",
            "remote_url_threads",
            "remote_url_task_size",
            "remote_url_expires_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidInput(f"{name} must be a positive integer, got {value!r}")
        if self.remote_backend not in _REMOTE_BACKENDS:
            raise InvalidInput(
                f"remote_backend must be one of {_REMOTE_BACKENDS}, got {self.remote_backend!r}"
            )
        if not isinstance(self.remote_url_min_bytes, int) or self.remote_url_min_bytes < 0:
            raise InvalidInput("remote_url_min_bytes must be a non-negative integer")
        if self.alignment < 1 or self.alignment & (self.alignment - 1):
            raise InvalidInput(f"alignment must be a power of two, got {self.alignment}")
        if self.prefetch_batch_size < self.alignment:
            raise InvalidInput("prefetch_batch_size must be at least one alignment unit")
        if not 0.0 <= self.cold_threshold <= 1.0:
            raise InvalidInput("cold_threshold must be in [0, 1]")
        if self.remote_pieces < 2 or self.remote_piece_size < 4096:
            raise InvalidInput("remote_pieces must be at least 2, remote_piece_size 4096 bytes")
        # Freeze the mapping so a shared config cannot change under a running storage.
        object.__setattr__(self, "tier_io", MappingProxyType(dict(self.tier_io)))

    def io_for(self, tier: str | None, rank: int | None) -> TierIo:
        """Return the settings for a tier (``None`` for files outside every tier)."""
        if tier is not None and tier in self.tier_io:
            return self.tier_io[tier]
        if rank is None or rank == 0:
            return self.fast_tier_io
        return self.slow_tier_io
