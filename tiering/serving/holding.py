"""What one lease is: its :class:`LeaseSpec`, the :class:`Lease` itself, and the
:class:`Holding` that counts who holds its buffer (see :mod:`tiering.serving.leases`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tiering.io import Device, IoReport
from tiering.io.buffers import DeviceBuffer

__all__ = ["Holding", "Lease", "LeaseSpec"]


class Holding:
    """Who holds one granted buffer: its leases and pins (see :meth:`LeaseTable.hold`).

    Made by :meth:`LeaseTable.grant`; ``count`` falls to 0 exactly once, and the buffer is then
    freed (or pooled). ``on_last`` is called just before that, outside the table's lock.
    ``kept``: the residency is one of the holders (:meth:`LeaseTable.keep`); ``on_idle`` is
    called, outside the lock, each time it becomes the only one.
    """

    __slots__ = ("buffer", "count", "kept", "on_idle", "on_last")

    def __init__(self, buffer: DeviceBuffer) -> None:
        self.buffer = buffer
        self.count = 1
        self.kept = False
        self.on_last: Callable[[Holding], None] | None = None
        self.on_idle: Callable[[Holding], None] | None = None

    @property
    def idle(self) -> bool:
        """Kept, and held by nothing else (no lease, no load copying from it)."""
        return self.kept and self.count == 1


@dataclass(frozen=True)
class LeaseSpec:
    """What a new lease says about its bytes, the same whether its buffer is new
    (:meth:`LeaseTable.grant`) or shared (:meth:`LeaseTable.share`).

    ``nbytes`` of data start at ``offset`` inside the allocation; ``dtype`` and ``shape``
    describe them; ``kind`` is the load's (``load``, ``gather``, ``safetensors``,
    ``prefetch``) and ``file_ids`` the files read; ``report`` how the bytes came. ``tensors``
    (safetensors loads): name → ``(offset, dtype, shape, nbytes)`` inside the buffer.
    ``ttl_s``: the lease's lifetime (None: the table's default).
    """

    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    kind: str
    file_ids: tuple[int, ...]
    report: IoReport | None = None
    ttl_s: float | None = None
    offset: int = 0
    tensors: dict[str, Any] | None = None


@dataclass
class Lease:
    """One leased buffer.

    ``nbytes`` of data start at ``offset`` inside the allocation; ``dtype`` and ``shape``
    describe them. ``tensors`` is set for safetensors loads: name → ``(offset, dtype, shape,
    nbytes)`` inside this buffer. ``read_only`` leases hand out a buffer that other leases
    may share (the holder promised never to write it); ``reused`` says this lease was granted
    over such a buffer that was already resident (no byte was read for it).
    """

    id: str
    device: Device
    buffer: DeviceBuffer
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    created_at: float
    expires_at: float
    ttl_s: float
    kind: str
    file_ids: tuple[int, ...]
    report: IoReport | None
    offset: int = 0
    tensors: dict[str, Any] = field(default_factory=dict)
    read_only: bool = False
    reused: bool = False
    holding: Holding | None = field(default=None, repr=False, compare=False)

    @property
    def alloc_bytes(self) -> int:
        return self.buffer.alloc_bytes

    def handle(self) -> dict[str, Any]:
        """The buffer's handle, with the data's offset and whether it is read-only."""
        h = self.buffer.handle()
        h["offset"] = self.offset
        h["read_only"] = self.read_only
        return h
