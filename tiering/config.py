"""Plain configuration objects the engine receives.

Only ``app.settings`` reads the environment or files; the engine gets these frozen dataclasses,
so it can be used as a library with no service around it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["STORAGE_KINDS", "EngineConfig", "TierConfig"]

#: The kinds of tier that hold files' authoritative bytes. ``"memory"`` is the other kind: a
#: cache of copies above them (see :class:`TierConfig`).
STORAGE_KINDS = ("directory", "object")


@dataclass(frozen=True)
class TierConfig:
    """One tier. Its rank is its position in the tier list (0 = fastest).

    ``kind`` picks the backend: ``"directory"`` (a local root at ``path``) or ``"object"`` (an
    S3-protocol bucket prefix at ``url``, ``s3://bucket/prefix``, reached at ``endpoint_url``
    in ``region``; credentials come from the standard AWS chain, never from here).
    ``"memory"`` is not storage: it caches copies of files in pinned host memory, up to
    ``quota_bytes`` (required), above the storage tiers; it has no path and no rank among them.
    ``part_size`` (bytes of one multipart part and of one ranged GET) and ``connections``
    (requests in flight) tune an object tier; None keeps the backend's defaults.
    """

    name: str
    path: Path | None = None
    quota_bytes: int | None = None
    kind: str = "directory"
    url: str | None = None
    endpoint_url: str | None = None
    region: str | None = None
    part_size: int | None = None
    connections: int | None = None
    #: Store the files written here in tierd's compressed format where it pays (directory
    #: tiers): ``"on"``, ``"off"``, or ``"auto"``: on for the slow tiers (see
    #: :class:`~tiering.tiers.DirectoryTier`).
    compression: str = "auto"

    @property
    def is_memory(self) -> bool:
        return self.kind == "memory"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to run.

    ``tiers`` may list a memory tier (``kind="memory"``): at most one, first (it sits above
    every storage tier). It is taken out into ``memory``, so ``tiers`` always holds the storage
    tiers alone, ranked 0.. fastest first (what the data path and the catalog know).
    ``host_id`` names this host in the catalog's table of cached copies;
    ``memory_floor_bytes`` is the MemAvailable under which the memory tier drops its coldest
    copies (None: max(1 GiB, 5 % of MemTotal)), checked every ``memory_pressure_interval_s``.

    Raises
    ------
    ValueError
        Two memory tiers, a memory tier not listed first, without a quota or with a path or
        url, or no storage tier.
    """

    tiers: tuple[TierConfig, ...]
    catalog_url: str
    half_life_s: float = 86_400.0
    access_flush_interval_s: float = 1.0
    max_upload_bytes: int = 1 << 40
    default_tier: str | None = None
    scan_on_start: bool = True
    busy_timeout_ms: int = 5000
    watch: bool = True
    watch_backend: str = "auto"
    watch_settle_s: float = 1.0
    watch_poll_interval_s: float = 1.0
    reconcile_files_per_s: float | None = 20_000.0
    remote_reconcile_s: float = 300.0
    memory: TierConfig | None = None
    host_id: str = field(default_factory=socket.gethostname)
    memory_floor_bytes: int | None = None
    memory_pressure_interval_s: float = 1.0
    # The fleet (hosts sharing a catalog): the URL this host's API is reached at, published in
    # its row of the hosts table ("" leaves the engine unregistered: a library use with no API),
    # how often its heartbeat is stamped, and the age past which a host is shown down.
    advertise_url: str = ""
    heartbeat_interval_s: float = 5.0
    host_timeout_s: float = 30.0
    # The fleet credential this host sends on peer reads (its loads and fills taking bytes from
    # other hosts); None: it reads no peer's bytes (and, in the app, serves none).
    fleet_token: str | None = field(default=None, repr=False)
    # K: the most hosts reading one file generation from the bucket at once.
    origin_readers: int = 1
    # The polls a second the hosts filling one generation ask of the tracker together, at most
    # (each polls every 0.1 s in a fleet small enough; see tiering.fleet.peerwindow).
    tracker_polls: float = 2000.0

    def __post_init__(self) -> None:
        tiers = tuple(self.tiers)
        memory = [t for t in tiers if t.is_memory]
        if self.memory is not None:
            memory.insert(0, self.memory)
        if len(memory) > 1:
            names = ", ".join(t.name for t in memory)
            raise ValueError(f"at most one memory tier may be configured, got {names}")
        if any(t.is_memory for t in tiers[1:]):
            raise ValueError(
                f"memory tier {memory[0].name!r} must be listed first: it sits above every "
                "storage tier"
            )
        storage = tuple(t for t in tiers if not t.is_memory)
        if not storage:
            raise ValueError("at least one storage tier (a directory or a bucket) is required")
        if memory:
            m = memory[0]
            if m.quota_bytes is None or m.quota_bytes <= 0:
                raise ValueError(f"memory tier {m.name!r} needs quota_bytes: its size cap")
            if m.path is not None or m.url is not None:
                raise ValueError(f"memory tier {m.name!r} takes no path or url")
            if m.name in {t.name for t in storage}:
                raise ValueError(f"tier names must be unique: {m.name!r} is used twice")
        # Frozen: the split is made once, here, so every reader sees storage tiers only.
        object.__setattr__(self, "tiers", storage)
        object.__setattr__(self, "memory", memory[0] if memory else None)

    def tier_names(self) -> list[str]:
        """Every tier the policy has rules for: the memory tier (if any), then storage."""
        head = [self.memory.name] if self.memory is not None else []
        return head + [t.name for t in self.tiers]
