"""An earlier tierd's layout brought to this one's, once, before recovery and the scan.

Directory tiers kept their containers at the files' own paths and told them by their first
bytes, which took a user's file that happened to begin with the container's magic for one.
They now keep them under ``.tierd-compressed`` (where a file is says what it is). A tier
without that directory yet may hold containers at their old places: the catalog's records
with a codec name them, and each is moved to its place (a rename within the tier's root).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import partial

from tiering.catalog import Catalog
from tiering.tiers import Tier
from tiering.tiers.paths import COMPRESSED_DIR

__all__ = ["relocate_containers"]

log = logging.getLogger(__name__)


def _containers(catalog: Catalog, tier: str) -> list[str]:
    return [r.relpath for r in catalog.compressed_on(tier)]


def relocate_containers(catalog: Catalog, tiers: Iterable[Tier]) -> list[str]:
    """Move the containers of the records that say so to where their tier reads them (see
    :meth:`Tier.relocate_containers <tiering.tiers.Tier.relocate_containers>`); the relpaths
    moved."""
    moved: list[str] = []
    for tier in tiers:
        done = tier.relocate_containers(partial(_containers, catalog, tier.name))
        if done:
            log.warning(
                "tier %s: %d compressed files moved to %s (the layout where a file's place "
                "says it is a container)",
                tier.name,
                len(done),
                COMPRESSED_DIR,
            )
        moved += done
    return moved
