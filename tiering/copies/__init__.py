"""Copies: caches of bytes whose authority is elsewhere.

Host copies of a fleet's shared files on this host's own tiers (:class:`HostCopies`, with the
copy files and passes that fill and drop them) and the memory tier's fills and drops
(:class:`MemoryCache`). A copy is never the only copy: dropping one loses nothing. What to copy
is decided in :mod:`tiering.placement`; this room carries the decisions out.
"""

from tiering.copies.hostcopies import HostCopies
from tiering.copies.memory import CachePassReport, MemoryCache
from tiering.copies.piecefill import FleetFills, PieceFill

__all__ = ["CachePassReport", "FleetFills", "HostCopies", "MemoryCache", "PieceFill"]
