"""What a resident copy is: the content it holds (:class:`ResidentKey`: a file's generation on a
device, and which bytes or tensors of it), the copy itself (:class:`Entry`: where the file's
bytes lie in it) and the single flight of the shared loads that make them (:class:`Claims`),
apart from the :class:`~tiering.serving.residency.Residency` that finds, hands out and lets go
of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiering.catalog import FileRecord, FileState
from tiering.io import Device
from tiering.io.safetensors import DTYPES, TensorInfo
from tiering.serving.held import Held, still_current
from tiering.serving.leases import Holding
from tiering.tiers import Stat, Tier

__all__ = ["Claims", "Entry", "ResidentKey"]

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
    """One resident copy: ``nbytes`` of data at the start of the buffer ``holding`` holds.

    ``base``: the file offset of the buffer's first byte where the copy is one run of the
    file's bytes (a byte range; a shard's tensors read in one span), None where it is not (a
    selection packed apart). ``head``: the file's bytes before ``base``, in host memory, where
    the copy runs to the file's end (a shard's header), so that the copy serves any read.
    """

    key: ResidentKey
    holding: Holding
    stat: Stat
    nbytes: int
    tensors: dict[str, Any] = field(default_factory=dict)
    used: int = 0  # when it was last handed out or copied from (a tick of the residency)
    base: int | None = None
    head: bytes | None = None

    def __post_init__(self) -> None:
        if self.key.what[0] == "bytes":
            self.base = int(self.key.what[1])
            if self.base == 0:
                self.head = b""

    @property
    def device(self) -> Device:
        return self.key.device

    def whole(self, rec: FileRecord) -> bool:
        """Whether it serves any read of the file: all of its bytes, with the head."""
        return (
            self.head is not None
            and self.base == len(self.head)
            and self.base + self.nbytes == rec.size
        )

    def covers(self, offset: int, length: int) -> int | None:
        """Where the file's bytes ``[offset, offset + length)`` start in the buffer; None
        when the copy does not hold them all."""
        if self.base is None or offset < self.base:
            return None
        at = offset - self.base
        return at if at + length <= self.nbytes else None

    def layout(self, tensors: Iterable[TensorInfo]) -> dict[str, Any] | None:
        """The layout of ``tensors`` (as a safetensors lease names them) in this copy, each
        at an offset aligned to its item; None when one is not in it."""
        out: dict[str, Any] = {}
        for t in tensors:
            kept = self.tensors.get(t.name)
            at = int(kept["offset"]) if kept is not None else self.covers(t.begin, t.nbytes)
            if at is None or at % np.dtype(DTYPES[t.dtype].storage).itemsize:
                return None
            out[t.name] = {
                "offset": at,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "nbytes": t.nbytes,
            }
        return out

    def current(self, rec: FileRecord, tier: Tier) -> bool:
        """Still a copy of what ``rec`` names (generation, and the file on disk now)."""
        probe = Held(self.key.file_id, self.key.generation, self.stat, None, self.device, "gpu")
        return rec.state in _SERVABLE and still_current(probe, rec, tier)


class _Claim:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0


class Claims:
    """Single flight for shared loads: the keys a load is reading, held until it has made
    them resident, so a second load of one content waits and then finds the copy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: dict[ResidentKey, _Claim] = {}

    @contextlib.contextmanager
    def claim(self, keys: Iterable[ResidentKey]) -> Iterator[None]:
        """Hold ``keys`` against other shared loads until the block ends.

        The second of two shared loads of one content waits here while the first reads it, then
        finds its entry. Keys are taken in one total order, so two loads claiming overlapping
        sets never deadlock.
        """
        taken: list[tuple[ResidentKey, _Claim]] = []
        try:
            for key in sorted(set(keys), key=ResidentKey.order):
                with self._lock:
                    c = self._claims.get(key)
                    if c is None:
                        c = self._claims[key] = _Claim()
                    c.users += 1
                try:
                    c.lock.acquire()
                except BaseException:
                    self._unclaim(key, c)
                    raise
                taken.append((key, c))
            yield
        finally:
            for key, c in reversed(taken):
                c.lock.release()
                self._unclaim(key, c)

    def _unclaim(self, key: ResidentKey, c: _Claim) -> None:
        with self._lock:
            c.users -= 1
            if c.users == 0:
                del self._claims[key]
