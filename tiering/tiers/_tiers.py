"""The ordered tiers of one engine, each built by the backend its configuration names."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

from tiering.config import STORAGE_KINDS, TierConfig
from tiering.errors import CacheOnlyTier, TierNotFound
from tiering.tiers._base import Tier
from tiering.tiers._directory import DirectoryTier

__all__ = ["KINDS", "Tiers", "make_tier"]

#: The backends a storage tier's ``kind`` can name (``"memory"`` is a cache, not a Tier).
KINDS = STORAGE_KINDS


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
    if config.kind == "memory":
        raise ValueError(f"tier {config.name!r} is a memory tier: a cache, built as a MemoryTier")
    raise ValueError(f"tier {config.name!r}: unknown kind {config.kind!r}; one of {KINDS}")


class Tiers:
    """The ordered storage tiers of one engine, fastest first.

    ``caches`` names the memory tier (if any): it is no member (iteration, ``in``), and
    :meth:`get` refuses it with :class:`~tiering.errors.CacheOnlyTier`, so an upload, move or
    pin that names it is a clear error, never "no such tier".
    """

    def __init__(
        self, configs: tuple[TierConfig, ...] | list[TierConfig], *, caches: Collection[str] = ()
    ) -> None:
        names = [c.name for c in configs]
        if not configs:
            raise ValueError("at least one tier is required")
        if len(set(names)) != len(names) or set(names) & set(caches):
            raise ValueError(f"tier names must be unique: {[*caches, *names]}")
        self._tiers = [make_tier(c, rank) for rank, c in enumerate(configs)]
        self._by_name = {t.name: t for t in self._tiers}
        self.caches = tuple(caches)

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
            if name in self.caches:
                raise CacheOnlyTier(
                    f"{name} is a memory tier: it holds cached copies of files whose bytes stay "
                    f"on a storage tier, never a file of its own; name one of "
                    f"{', '.join(self._by_name)}",
                    tier=name,
                ) from None
            raise TierNotFound(
                f"no tier named {name!r}; tiers are {', '.join(self._by_name)}", tier=name
            ) from None

    @property
    def fastest(self) -> Tier:
        return self._tiers[0]

    def close(self) -> None:
        for t in self._tiers:
            t.close()
