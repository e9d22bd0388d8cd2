"""Loads served from the memory tier: the :class:`~tiering.serving.held.Holder` over
``engine.memory``.

A load asks it for a file before reading the file's tier (see
:meth:`~tiering.serving.context.LoadContext.open`). The copy it hands out is the memory tier's
pinned allocation itself, read-only: a load into ``cuda:N`` is one host → device DMA from it,
a load into ``cpu`` one memcpy. Acquiring pins the copy (no eviction, no pressure drop frees
it) and marks its use, until the load releases it.
"""

from __future__ import annotations

from tiering.catalog import FileRecord
from tiering.copies import MemoryCache
from tiering.engine import Engine
from tiering.errors import TierdError
from tiering.io import Device
from tiering.serving.held import Held, still_current

__all__ = ["MemoryHolder"]

_CPU = Device("cpu")


class MemoryHolder:
    """The memory tier of ``engine`` as a holder of copies."""

    def __init__(self, engine: Engine, memory: MemoryCache) -> None:
        self.engine = engine
        self.memory = memory

    def acquire(self, rec: FileRecord, device: Device) -> Held | None:
        """The memory tier's copy of ``rec`` at its generation, pinned until released.

        A copy that is not current any more (the file was rewritten on disk behind tierd's
        back, or moved) is dropped here, so the next load does not meet it again."""
        tier = self.memory.tier
        entry = tier.acquire(rec.id, rec.generation)
        if entry is None:
            return None
        assert entry.stat is not None
        held = Held(
            rec.id,
            entry.generation,
            entry.stat,
            entry.view(),
            _CPU,
            holder=self.memory.name,
            _release=lambda: tier.release(entry),
        )
        if not self._current(held, rec):
            held.release()
            tier.drop(rec.id, "stale", generation=entry.generation)
            return None
        return held

    def _current(self, held: Held, rec: FileRecord) -> bool:
        try:
            storage = self.engine.tiers.get(rec.tier)
        except TierdError:
            return False
        return still_current(held, rec, storage)
