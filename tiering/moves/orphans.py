"""Orphan temp files: what a crash left behind in the tiers, removed before serving."""

from __future__ import annotations

import logging
import os

from tiering.catalog.journal import Journal
from tiering.tiers import Tiers
from tiering.tiers.paths import is_temp_name

__all__ = ["remove_orphan_temps"]

log = logging.getLogger(__name__)


def remove_orphan_temps(journal: Journal, tiers: Tiers) -> int:
    """Remove every temp file in tierd's own naming pattern except those of failed migrations
    (kept as evidence); returns how many were removed.

    Only safe before serving and after recovery: then nothing is writing, so every other temp
    file is an orphan of a crash, and recovery has already decided what each open intent's
    files are.
    """
    keep = journal.failed_temp_names()
    removed = 0
    for tier in tiers:
        for rel in list(tier.temp_files()):
            name = os.path.basename(rel)
            if not is_temp_name(name) or name in keep:
                continue
            try:
                os.unlink(tier.root / rel)
                removed += 1
                log.info("removed orphan temp file %s in tier %s", rel, tier.name)
            except FileNotFoundError:
                pass  # gone already: nothing to clean
    return removed
