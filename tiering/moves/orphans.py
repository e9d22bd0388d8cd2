"""Orphan temps: what a crash left unpublished in the tiers (temp files, unfinished multipart
uploads), removed before serving."""

from __future__ import annotations

import logging

from tiering.catalog.journal import Journal
from tiering.tiers import Tiers
from tiering.tiers.paths import TEMP_SUFFIX

__all__ = ["remove_orphan_temps"]

log = logging.getLogger(__name__)


def remove_orphan_temps(journal: Journal, tiers: Tiers) -> int:
    """Remove every temp tierd's writers left, except the temp files of failed migrations
    (kept as evidence) and of open ones (another host's, on a shared tier); returns how many
    were removed.

    Only safe before serving and after recovery: then nothing of this host is writing, so every
    other temp file is an orphan of a crash, and recovery has already decided what each of its
    open intents' files are.
    """
    keep = journal.kept_temp_names()
    removed = 0
    for tier in tiers:
        for rel, stem in list(tier.temps()):
            if f".{stem}{TEMP_SUFFIX}" in keep:
                continue
            if tier.remove_temp(rel, stem):
                removed += 1
                log.info("removed an orphan temp of %s in tier %s", rel, tier.name)
    return removed
