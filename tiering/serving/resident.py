"""What a resident copy is: the content it holds (:class:`ResidentKey`: a file's generation on a
device, and which bytes or tensors of it) and the copy itself (:class:`Entry`), apart from the
:class:`~tiering.serving.residency.Residency` that finds, hands out and lets go of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tiering.catalog import FileRecord, FileState
from tiering.io import Device
from tiering.serving.held import Held, still_current
from tiering.serving.leases import Holding
from tiering.tiers import Stat, Tier

__all__ = ["Entry", "ResidentKey"]

_SERVABLE = (FileState.STABLE, FileState.MIGRATING)


@dataclass(frozen=True)
class ResidentKey:
    """What a resident copy holds: ``what`` is ``("bytes", offset, length)`` of the file, or
    ``("tensors", digest)`` for the packed safetensors tensors whose sorted names hash to
    ``digest`` (their layout is the entry's)."""

    file_id: int
    generation: int
    device: Device
    what: tuple[Any, ...]

    @staticmethod
    def bytes(rec: FileRecord, device: Device, offset: int, length: int) -> ResidentKey:
        return ResidentKey(rec.id, rec.generation, device, ("bytes", offset, length))

    @staticmethod
    def tensors(rec: FileRecord, device: Device, names: Iterable[str]) -> ResidentKey:
        # A digest, not the names: a large model's shard selects thousands of them.
        h = hashlib.sha256("\0".join(sorted(names)).encode()).hexdigest()
        return ResidentKey(rec.id, rec.generation, device, ("tensors", h))

    def order(self) -> tuple[str, int, int, str]:
        """A total order, so that loads claiming several keys never wait on each other."""
        return (str(self.device), self.file_id, self.generation, repr(self.what))


@dataclass(eq=False)
class Entry:
    """One resident copy: ``nbytes`` of data at the start of the buffer ``holding`` holds."""

    key: ResidentKey
    holding: Holding
    stat: Stat
    nbytes: int
    tensors: dict[str, Any] = field(default_factory=dict)
    used: int = 0  # when it was last handed out or copied from (a tick of the residency)

    @property
    def device(self) -> Device:
        return self.key.device

    def whole(self, rec: FileRecord) -> bool:
        return self.key.what == ("bytes", 0, rec.size)

    def current(self, rec: FileRecord, tier: Tier) -> bool:
        """Still a copy of what ``rec`` names (generation, and the file on disk now)."""
        probe = Held(self.key.file_id, self.key.generation, self.stat, None, self.device, "gpu")
        return rec.state in _SERVABLE and still_current(probe, rec, tier)
