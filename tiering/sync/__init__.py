"""Sync: keep the catalog true to what is in the tier roots. A full scan (adopt, mark missing,
report conflicts) and the live watcher that follows changes made by others."""

from tiering.sync.layout import relocate_containers
from tiering.sync.scan import ScanReport, reconcile_paths, scan
from tiering.sync.watcher import TierWatcher, WatcherStatus

__all__ = [
    "ScanReport",
    "TierWatcher",
    "WatcherStatus",
    "reconcile_paths",
    "relocate_containers",
    "scan",
]
