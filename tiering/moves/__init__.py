"""Moves: the crash-safe migration protocol of ``RELIABILITY.md`` between any two tiers, its
recovery at start, and single-file reads, uploads and deletes that are safe beside it."""

from tiering.moves.files import Content, FileOps, Upload
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
    ServingGate,
)
from tiering.moves.orphans import remove_orphan_temps

__all__ = [
    "STEPS",
    "Cancelled",
    "Claim",
    "FileGuards",
    "Mover",
    "Progress",
    "RateLimiter",
    "RecoveryReport",
    "ServingGate",
    "Content",
    "FileOps",
    "MigrationInfo",
    "Upload",
    "remove_orphan_temps",
]
