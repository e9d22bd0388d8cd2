"""How full each tier is: what the catalog places on it, what its filesystem has free, and the
room left under its quota. The planner plans with these numbers, uploads and moves are checked
against them, and the API shows them."""

from __future__ import annotations

from dataclasses import dataclass

from tiering.catalog import Catalog, FileRecord
from tiering.placement.policy import TierState
from tiering.tiers import Capabilities, Space, Tier, Tiers

__all__ = ["TierInfo", "room", "tier_infos", "tier_states"]


@dataclass(frozen=True)
class TierInfo:
    """One tier as the API shows it: where it is, its space, and what the catalog puts on it."""

    name: str
    rank: int
    kind: str
    path: str
    quota_bytes: int | None
    space: Space
    files: int
    used_bytes: int
    capabilities: Capabilities
    stored_bytes: int = 0


def tier_infos(catalog: Catalog, tiers: Tiers) -> list[TierInfo]:
    """Every tier, fastest first, with its configured quota and the catalog's usage."""
    usage = catalog.usage()
    out = []
    for t in tiers:
        u = usage.get(t.name)
        out.append(
            TierInfo(
                t.name,
                t.rank,
                t.kind,
                t.location,
                t.quota_bytes,
                t.space(),
                u.files if u else 0,
                u.bytes if u else 0,
                t.capabilities,
                u.stored if u else 0,
            )
        )
    return out


def tier_states(catalog: Catalog, tiers: Tiers) -> dict[str, TierState]:
    """What the planner knows of each tier now, by name."""
    usage = catalog.usage()
    out = {}
    for t in tiers:
        u = usage.get(t.name)
        # Quotas count the bytes files take on the tier (compressed ones' stored bytes).
        out[t.name] = TierState(t.name, u.stored if u else 0, t.space().free, t.quota_bytes)
    return out


def room(
    tier: Tier, catalog: Catalog, quota: int | None, replacing: FileRecord | None = None
) -> int:
    """Bytes that may still be written to ``tier``: free space, capped by ``quota``.

    ``replacing`` is a file the write replaces; its bytes on this tier do not count as used,
    since they go when the new ones arrive.
    """
    free = tier.space().free
    if quota is None:
        return free  # no need to ask the catalog what is used
    used = catalog.usage().get(tier.name)
    used_bytes = used.stored if used else 0  # quotas count stored bytes
    if replacing is not None and replacing.tier == tier.name:
        used_bytes -= replacing.size if replacing.stored_size is None else replacing.stored_size
    return min(free, max(0, quota - used_bytes))
