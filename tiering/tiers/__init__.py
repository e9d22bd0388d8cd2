"""Tiers: named storage ranked fastest first, and the rules for the relpaths inside them.

A tier is one implementation of :class:`Tier`'s few primitives (open for ranged reads, stat,
walk, write then publish, remove, space): :class:`DirectoryTier` for a local directory,
``ObjectTier`` for an S3-protocol bucket prefix. Moves, recovery, scan, uploads and loads use
only those primitives, and ask a tier what it can do (:class:`Capabilities`: shared origin or
this host's own, holds copies, local files, direct GPU reads, reads pinned to an ETag) rather
than which backend it is.

:class:`MemoryTier` is no Tier: it caches copies of files in pinned host memory above them,
and never holds a file of its own.
"""

from tiering.tiers._base import (
    UNBOUNDED,
    Aborting,
    Capabilities,
    LocalFile,
    Published,
    Source,
    Space,
    Stat,
    Tier,
    WalkEntry,
    Writer,
)
from tiering.tiers._directory import DirectorySource, DirectoryTier
from tiering.tiers._dirwriter import DirectoryWriter, pread_exact, write_all
from tiering.tiers._memory import FillCancelled, MemoryEntry, MemoryTier
from tiering.tiers._tiers import KINDS, Tiers, make_tier, overlap
from tiering.tiers._writeback import start_writeback

__all__ = [
    "start_writeback",
    "pread_exact",
    "KINDS",
    "UNBOUNDED",
    "Aborting",
    "Capabilities",
    "DirectorySource",
    "DirectoryTier",
    "DirectoryWriter",
    "FillCancelled",
    "LocalFile",
    "MemoryEntry",
    "MemoryTier",
    "Published",
    "Source",
    "Space",
    "Stat",
    "Tier",
    "Tiers",
    "WalkEntry",
    "Writer",
    "make_tier",
    "overlap",
    "write_all",
]
