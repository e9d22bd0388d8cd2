"""The ordered tiers of one engine, each built by the backend its configuration names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tiering.config import TierConfig
from tiering.errors import TierNotFound
from tiering.tiers._base import Tier
from tiering.tiers._directory import DirectoryTier

__all__ = ["KINDS", "Tiers", "make_tier"]

#: The backends a tier's ``kind`` can name.
KINDS = ("directory", "object")


def make_tier(config: TierConfig, rank: int) -> Tier:
    """The tier ``config`` describes, at ``rank``."""
    if config.kind == "directory":
        return DirectoryTier(config, rank)
    if config.kind == "object":
        # boto3 is imported only by deployments that have an object-store tier.
        from tiering.tiers._object import ObjectTier

        tuning: dict[str, Any] = {}
        if config.part_size is not None:
            tuning["part_size"] = tuning["read_size"] = config.part_size
            tuning["readahead_bytes"] = (config.connections or 64) * config.part_size
        if config.connections is not None:
            tuning["workers"] = config.connections
        tier: Tier = ObjectTier(config, rank, **tuning)
        return tier
    raise ValueError(f"tier {config.name!r}: unknown kind {config.kind!r}; one of {KINDS}")


class Tiers:
    """The ordered tiers of one engine, fastest first."""

    def __init__(self, configs: tuple[TierConfig, ...] | list[TierConfig]) -> None:
        names = [c.name for c in configs]
        if not configs:
            raise ValueError("at least one tier is required")
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique: {names}")
        self._tiers = [make_tier(c, rank) for rank, c in enumerate(configs)]
        self._by_name = {t.name: t for t in self._tiers}

    def __iter__(self) -> Iterator[Tier]:
        return iter(self._tiers)

    def __len__(self) -> int:
        return len(self._tiers)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str) -> Tier:
        try:
            return self._by_name[name]
        except KeyError:
            raise TierNotFound(
                f"no tier named {name!r}; tiers are {', '.join(self._by_name)}", tier=name
            ) from None

    @property
    def fastest(self) -> Tier:
        return self._tiers[0]

    def close(self) -> None:
        for t in self._tiers:
            t.close()
