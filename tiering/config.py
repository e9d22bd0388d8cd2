"""Plain configuration objects the engine receives.

Only ``app.settings`` reads the environment or files; the engine gets these frozen dataclasses,
so it can be used as a library with no service around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["EngineConfig", "TierConfig"]


@dataclass(frozen=True)
class TierConfig:
    """One tier. Its rank is its position in the tier list (0 = fastest).

    ``kind`` picks the backend: ``"directory"`` (a local root at ``path``) or ``"object"`` (an
    S3-protocol bucket prefix at ``url``, ``s3://bucket/prefix``, reached at ``endpoint_url``
    in ``region``; credentials come from the standard AWS chain, never from here).
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


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to run."""

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

    def tier_names(self) -> list[str]:
        return [t.name for t in self.tiers]
