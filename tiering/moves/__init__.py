"""Moves: the crash-safe migration protocol of ``RELIABILITY.md``, its recovery at start, and
the crash-safe file operations (temp file, fsync, no-clobber publish) it and uploads share."""

from tiering.moves.fsops import AtomicWriter, Published, write_all
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
]
