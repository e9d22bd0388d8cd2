"""Every setting of tierd, with its default and a one-line description (the settings of loads,
``buffers`` and ``io``, in :mod:`app.settings_loads`).

Sources, strongest first: CLI flags, ``TIERD_*`` environment variables (nested with ``__``),
the TOML file named by ``--config`` or ``TIERD_CONFIG``, then the defaults below. Settings are
built by :func:`get_settings`, never at import time.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from tiering.catalog.backends import normalize_url, sqlite_file
from tiering.config import EngineConfig, TierConfig
from tiering.serving.fleetjobs import FleetWorkerConfig
from tiering.tiers import overlap

from .settings_loads import BufferSettings, IoSettings

__all__ = ["BufferSettings", "Settings", "TierSettings", "get_settings"]

DEFAULT_TIER_NAMES = ("nvme", "ssd", "hdd")


class TierSettings(BaseModel):
    """One tier: a directory (``path``), an S3-protocol bucket prefix (``url``), or a memory
    tier (``kind = "memory"`` with ``quota_bytes``): copies of hot files in pinned host memory,
    a cache above the storage tiers, listed first.

    Credentials of an object-store tier come from the standard AWS chain (environment, shared
    config and credentials files, instance role), never from tierd's configuration.
    """

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,63}$", description="Tier name, e.g. nvme")
    kind: Literal["directory", "object", "memory"] | None = Field(
        default=None,
        description="directory, object or memory; default by path (directory) or url (object)",
    )
    path: Path | None = Field(default=None, description="Directory root of a directory tier")
    url: str | None = Field(
        default=None,
        pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$",
        description="s3://bucket/prefix of an object-store tier",
    )
    endpoint_url: str | None = Field(
        default=None, description="S3 endpoint (MinIO, Ceph RGW, GCS...); AWS when not set"
    )
    region: str | None = Field(default=None, description="Region of the bucket")
    part_size_bytes: int | None = Field(
        default=None,
        ge=5 << 20,
        le=5 << 30,
        description="Object tiers: bytes of one multipart part and of one ranged GET",
    )
    connections: int | None = Field(
        default=None, ge=1, le=1024, description="Object tiers: requests in flight"
    )
    quota_bytes: int | None = Field(default=None, ge=0, description="Most bytes tierd places here")
    compression: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Store the files tierd writes to this tier compressed where it pays "
        "(bf16 weights: about 0.7 of their size). auto: on for directory tiers from the third "
        "tier down and for object tiers (objects adopted from a bucket stay as they are); off "
        "for the two fastest directory tiers",
    )

    @model_validator(mode="after")
    def _one_backend(self) -> TierSettings:
        if self.compression == "on" and self.kind == "memory":
            raise ValueError(
                f"tier {self.name!r}: compression is for directory and object tiers (the "
                "memory tier holds what GPUs read)"
            )
        if self.kind == "memory":
            if self.path is not None or self.url is not None:
                raise ValueError(
                    f"tier {self.name!r} is a memory tier: it takes no path or url, only "
                    "quota_bytes"
                )
            if not self.quota_bytes:
                raise ValueError(f"memory tier {self.name!r} needs quota_bytes: its size cap")
            return self
        if self.kind is not None and (self.kind == "object") != (self.url is not None):
            raise ValueError(
                f"tier {self.name!r}: kind {self.kind} takes "
                f"{'a url' if self.kind == 'object' else 'a path'}"
            )
        if (self.path is None) == (self.url is None):
            raise ValueError(f"tier {self.name!r} needs exactly one of path (a directory) or url")
        remote = (self.endpoint_url, self.region, self.part_size_bytes, self.connections)
        if self.url is None and any(v is not None for v in remote):
            raise ValueError(
                f"tier {self.name!r}: endpoint_url, region, part_size_bytes and connections "
                "are for object-store (url) tiers"
            )
        return self

    def config(self) -> TierConfig:
        if self.kind == "memory":
            return TierConfig(self.name, quota_bytes=self.quota_bytes, kind="memory")
        if self.url is not None:
            return TierConfig(
                self.name,
                quota_bytes=self.quota_bytes,
                kind="object",
                url=self.url,
                endpoint_url=self.endpoint_url,
                region=self.region,
                part_size=self.part_size_bytes,
                connections=self.connections,
            )
        return TierConfig(self.name, self.path, self.quota_bytes, compression=self.compression)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="TIERD_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    data_dir: Path = Field(
        default=Path("tierd-data"), description="Where the embedded default keeps tiers and catalog"
    )
    tiers: list[TierSettings] = Field(
        default_factory=list,
        description="Ordered tiers, fastest first (a memory tier, if any, first of all); "
        "default <data_dir>/{nvme,ssd,hdd}",
    )
    host_id: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        max_length=255,
        description="This host's name in the catalog's table of cached copies",
    )
    memory_floor_bytes: int | None = Field(
        default=None,
        ge=0,
        description="MemAvailable under which the memory tier drops its coldest copies; "
        "default max(1 GiB, 5% of RAM)",
    )
    memory_pressure_interval_s: float = Field(
        default=1.0, gt=0, description="How often the memory tier checks the host's free memory"
    )
    catalog_url: str = Field(
        default="",
        description="SQLAlchemy URL: sqlite:///path/catalog.db (default <data_dir>/catalog.db), "
        "or postgresql+psycopg://user@host:5432/db for hosts sharing one catalog",
    )
    host: str = Field(default="127.0.0.1", description="Address to listen on")
    port: int = Field(default=8470, ge=0, le=65535, description="Port to listen on")
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host names a tierd without tokens answers to besides loopback names, the "
        "address it listens on and its advertise_url's host (by default this machine's "
        "hostname): a request naming any other is refused (DNS rebinding); with tokens, set "
        "it to check Host there too",
    )
    advertise_url: str = Field(
        default="",
        max_length=1024,
        pattern=r"^(https?://\S+)?$",
        description="URL other hosts and schedulers reach this host's API at, shown in the "
        "fleet's table of hosts; default http://<hostname>:<port>",
    )
    heartbeat_interval_s: float = Field(
        default=5.0, gt=0, description="How often this host stamps its heartbeat in the catalog"
    )
    host_timeout_s: float = Field(
        default=30.0, gt=0, description="Heartbeat age past which a host is shown down"
    )
    fleet_poll_interval_s: float = Field(
        default=1.0, gt=0, description="How often an idle host looks for its fleet job tasks"
    )
    fleet_claim_ttl_s: float = Field(
        default=30.0, gt=0, description="How long a host's claim on a fleet task holds unrenewed"
    )
    fleet_task_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Heartbeat age past which a host's open fleet tasks fail, with the reason",
    )
    fleet_origin_readers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="The most hosts reading one file generation from the bucket at once; the "
        "others take its pieces from peers",
    )
    fleet_tracker_polls: float = Field(
        default=EngineConfig.tracker_polls,
        gt=0,
        description="The polls a second the hosts filling one file ask of the catalog together, "
        "at most: each polls every 0.1 s, less often in a fleet larger than a tenth of this",
    )
    admin_token: str | None = Field(default=None, description="Bearer token for every route")
    data_token: str | None = Field(default=None, description="Bearer token for data routes")
    fleet_token: str | None = Field(
        default=None,
        description="Bearer credential the hosts of a fleet send on peer reads (/v1/peer); "
        "none: this host serves no peer reads",
    )
    half_life_s: float = Field(default=86_400.0, gt=0, description="Heat half-life in seconds")
    access_flush_interval_s: float = Field(
        default=1.0, gt=0, description="How often counted accesses are written to the catalog"
    )
    max_upload_bytes: int = Field(default=1 << 40, gt=0, description="Largest upload accepted")
    default_tier: str | None = Field(
        default=None, description="Tier for new uploads that name none; default the fastest"
    )
    scan_on_start: bool = Field(default=True, description="Reconcile tiers with catalog at start")
    busy_timeout_ms: int = Field(
        default=5000, ge=0, description="How long a catalog write waits for a lock before 503"
    )
    watch: bool = Field(default=True, description="Follow changes made to tier roots from outside")
    watch_backend: Literal["auto", "inotify", "polling"] = Field(
        default="auto", description="auto: inotify, else polling with a logged reason"
    )
    watch_settle_s: float = Field(
        default=1.0, ge=0, description="Quiet time before a changed file is (re)hashed"
    )
    watch_poll_interval_s: float = Field(default=1.0, gt=0, description="Polling backend period")
    remote_reconcile_s: float = Field(
        default=300.0,
        gt=0,
        description="Period of the full reconcile of object-store tiers (they have no events)",
    )
    reconcile_files_per_s: float | None = Field(
        default=20_000.0, gt=0, description="Pace of full reconciles (after overflow or restart)"
    )
    max_inflight_requests: int = Field(
        default=512, ge=1, description="Requests served at once; more get 429"
    )
    log_level: str = Field(default="info", description="debug, info, warning or error")
    log_format: Literal["text", "json"] = Field(
        default="text", description="text, or json: one JSON object per log line (with request_id)"
    )
    buffers: BufferSettings = Field(
        default_factory=BufferSettings,
        description="Buffer leases, budgets and prefetch jobs (TIERD_BUFFERS__*)",
    )
    io: IoSettings = Field(
        default_factory=IoSettings,
        description="The engines of loads: local files, object stores by URL (TIERD_IO__*)",
    )

    @field_validator("catalog_url")
    @classmethod
    def _supported_catalog(cls, url: str) -> str:
        # Refused here with the reason, not when the engine first connects.
        return normalize_url(url) if url else url

    @field_validator("tiers")
    @classmethod
    def _unique_tiers(cls, tiers: list[TierSettings]) -> list[TierSettings]:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        memory = [t.name for t in tiers if t.kind == "memory"]
        if len(memory) > 1:
            raise ValueError(f"at most one memory tier may be configured, got {memory}")
        if memory and tiers[0].kind != "memory":
            raise ValueError(
                f"memory tier {memory[0]!r} must be listed first: it sits above every storage tier"
            )
        if memory and len(tiers) == 1:
            raise ValueError(
                f"memory tier {memory[0]!r} caches copies of files on storage tiers: list at "
                "least one directory or bucket tier after it"
            )
        return tiers

    @model_validator(mode="after")
    def _fill_defaults(self) -> Settings:
        # Absolute, so that a later chdir (or a daemon manager) cannot move the data.
        self.data_dir = self.data_dir.absolute()
        for t in self.tiers:
            if t.path is not None:
                t.path = t.path.absolute()
        if not self.tiers:
            self.tiers = [TierSettings(name=n, path=self.data_dir / n) for n in DEFAULT_TIER_NAMES]
        if not self.catalog_url:
            self.catalog_url = f"sqlite:///{self.data_dir / 'catalog.db'}"
        # Refused here, naming both tiers, rather than when the engine builds them.
        why = overlap(
            [t.config() for t in self.tiers if t.kind != "memory"],
            catalog=sqlite_file(self.catalog_url),
        )
        if why is not None:
            raise ValueError(why)
        storage = {t.name for t in self.tiers if t.kind != "memory"}
        if self.default_tier is not None and self.default_tier not in storage:
            raise ValueError(f"default_tier {self.default_tier!r} is not one of the storage tiers")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

    # -- derived -----------------------------------------------------------------------------
    @property
    def auth_enabled(self) -> bool:
        return bool(self.admin_token or self.data_token)

    def host_names(self) -> list[str] | None:
        """The names a request's ``Host`` may give (see :mod:`app.browsers`), or None where
        any name is taken (tokens configured, no ``allowed_hosts``)."""
        if self.auth_enabled and not self.allowed_hosts:
            return None
        advertised = urlsplit(self.own_url()).hostname
        return [self.host, *(self.allowed_hosts), *([advertised] if advertised else [])]

    def own_url(self) -> str:
        """The URL other hosts reach this one at: ``advertise_url``, or http://<hostname>:<port>."""
        return self.advertise_url or f"http://{socket.gethostname()}:{self.port}"

    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            tiers=tuple(t.config() for t in self.tiers),
            catalog_url=self.catalog_url,
            half_life_s=self.half_life_s,
            access_flush_interval_s=self.access_flush_interval_s,
            max_upload_bytes=self.max_upload_bytes,
            default_tier=self.default_tier,
            scan_on_start=self.scan_on_start,
            busy_timeout_ms=self.busy_timeout_ms,
            watch=self.watch,
            watch_backend=self.watch_backend,
            watch_settle_s=self.watch_settle_s,
            watch_poll_interval_s=self.watch_poll_interval_s,
            reconcile_files_per_s=self.reconcile_files_per_s,
            remote_reconcile_s=self.remote_reconcile_s,
            host_id=self.host_id,
            memory_floor_bytes=self.memory_floor_bytes,
            memory_pressure_interval_s=self.memory_pressure_interval_s,
            advertise_url=self.own_url(),
            heartbeat_interval_s=self.heartbeat_interval_s,
            host_timeout_s=self.host_timeout_s,
            fleet_token=self.fleet_token,
            origin_readers=self.fleet_origin_readers,
            tracker_polls=self.fleet_tracker_polls,
        )

    def fleet_worker_config(self) -> FleetWorkerConfig:
        return FleetWorkerConfig(
            poll_interval_s=self.fleet_poll_interval_s,
            claim_ttl_s=self.fleet_claim_ttl_s,
            task_timeout_s=self.fleet_task_timeout_s,
        )


def get_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build settings from flags (``overrides``), env, and the TOML file, in that order.

    ``None`` overrides are ignored, so CLI options that were not given fall through.
    """
    path = config_file or os.environ.get("TIERD_CONFIG")
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    cls: type[Settings] = Settings
    if path is not None:
        cls = type(
            "Settings", (Settings,), {"model_config": {**Settings.model_config, "toml_file": path}}
        )
    return cls(**{k: v for k, v in overrides.items() if v is not None})
