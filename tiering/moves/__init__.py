"""Moves: the crash-safe migration protocol of ``RELIABILITY.md``, its recovery at start, and
the crash-safe file operations (temp file, fsync, no-clobber publish) it and uploads share."""

from tiering.moves.files import Content, FileOps, Upload
from tiering.moves.fsops import AtomicWriter, Published, write_all
from tiering.moves.history import MigrationInfo
from tiering.moves.mover import (
    STEPS,
    Cancelled,
    Claim,
    FileGuards,
    Mover,
    Progress,
    RateLimiter,
    RecoveryReport,
)
from tiering.moves.orphans import remove_orphan_temps

__all__ = [
    "STEPS",
    "AtomicWriter",
    "Cancelled",
    "Claim",
    "FileGuards",
    "Mover",
    "Progress",
    "Published",
    "RateLimiter",
    "RecoveryReport",
    "write_all",
    "Content",
    "FileOps",
    "MigrationInfo",
    "Upload",
    "remove_orphan_temps",
]
