"""Tiers: named storage roots ranked fastest first, and the rules for the relpaths inside them.

Today every tier is a local directory (:class:`Tier`); the object-store and memory tiers will be
further implementations of the same few primitives (open, stat, walk, publish, delete, space).
"""

from tiering.tiers._directory import Space, Tier, Tiers, WalkEntry

__all__ = ["Space", "Tier", "Tiers", "WalkEntry"]
