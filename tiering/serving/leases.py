"""Leases: buffers the service filled for a client, with a TTL and a per-device byte budget.

The budget is reserved *before* anything is allocated (:meth:`LeaseTable.reserve`), so
concurrent requests together never hold more than it, not even for a moment. A reservation
becomes a lease when the load succeeded (:meth:`LeaseTable.grant`) and is given back when it
failed. Expired leases are freed by a reaper thread; :meth:`LeaseTable.stop` frees them all.

Several leases may hand out one buffer (:meth:`LeaseTable.share`): the read-only copies of
``shared=true`` loads and GPU prefetches (see :mod:`tiering.serving.residency`). A
:class:`Holding` counts who holds such a buffer (its leases, and loads copying from it): its
bytes are charged against the budget once, and it goes back to the pool only when the last
holder lets go. A holding is never revived: a buffer taken again from the pool gets a new
one, so a stale reference can never hand out another load's bytes.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from tiering.errors import BufferNotFound, InsufficientSpace, InvalidInput
from tiering.io import Device, IoReport
from tiering.io.bufferpool import BufferPool
from tiering.io.buffers import DeviceBuffer
from tiering.periodic import Periodic

__all__ = ["Holding", "Lease", "LeaseSpec", "LeaseTable", "Reservation"]

log = logging.getLogger(__name__)


class Holding:
    """Who holds one granted buffer: its leases and pins (see :meth:`LeaseTable.hold`).

    Made by :meth:`LeaseTable.grant`; ``count`` falls to 0 exactly once, and the buffer is then
    freed (or pooled). ``on_last`` is called just before that, outside the table's lock.
    """

    __slots__ = ("buffer", "count", "on_last")

    def __init__(self, buffer: DeviceBuffer) -> None:
        self.buffer = buffer
        self.count = 1
        self.on_last: Callable[[Holding], None] | None = None


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


class Reservation:
    """Budget held for an allocation that is about to be made; see :meth:`LeaseTable.reserve`.

    Use it as a context manager: leaving it without :meth:`LeaseTable.grant` gives the bytes
    back (and frees a buffer attached with :meth:`attach`).
    """

    def __init__(self, table: LeaseTable, device: Device, nbytes: int) -> None:
        self.table = table
        self.device = device
        self.nbytes = nbytes
        self.buffer: DeviceBuffer | None = None
        self._open = True

    def attach(self, buffer: DeviceBuffer) -> DeviceBuffer:
        """Tie the allocation made under this reservation to it (freed if not granted)."""
        self.buffer = buffer
        return buffer

    def cancel(self) -> None:
        """Free the attached buffer and give the bytes back. Idempotent."""
        if not self._open:
            return
        self._open = False
        buf, self.buffer = self.buffer, None
        try:
            if buf is not None:
                self.table.pool.put(buf)
        finally:
            self.table._unreserve(self.device, self.nbytes)

    def _granted(self) -> None:
        if not self._open:
            raise InvalidInput("this reservation was already used or cancelled")
        self._open = False

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()


class LeaseTable:
    """Leases by id, the bytes each device has leased, and the reaper of expired ones.

    Parameters
    ----------
    budget:
        ``budget(device)``: the most bytes that may be leased on a device. Asked once per
        device, at its first reservation.
    ttl_s:
        Default lifetime of a lease; renewing restarts it.
    max_ttl_s:
        Longest lifetime a caller may ask for.
    reap_interval_s:
        How often the reaper looks for expired leases.
    clock:
        Wall-clock time (``expires_at`` is shown to clients).
    pool:
        Where freed buffers go, and new ones come from (idle GPU allocations kept for
        reuse). Idle buffers count against the budget too: a reservation trims them first.
    """

    def __init__(
        self,
        budget: Callable[[Device], int],
        *,
        ttl_s: float = 300.0,
        max_ttl_s: float = 3600.0,
        reap_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        pool: BufferPool | None = None,
    ) -> None:
        self._budget_of = budget
        self.pool = pool or BufferPool(max_idle_bytes=0)
        self.ttl_s = ttl_s
        self.max_ttl_s = max_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._used: dict[Device, int] = {}
        self._budgets: dict[Device, int] = {}
        self._reaper = Periodic(self._reap_and_log, reap_interval_s, "tierd-lease-reaper")
        self.expired_total = 0

    # -- budget ------------------------------------------------------------------------------
    def budget(self, device: Device) -> int:
        """The byte budget of ``device``."""
        with self._lock:
            found = self._budgets.get(device)
        if found is None:
            found = max(0, int(self._budget_of(device)))  # may ask CUDA: outside the lock
            with self._lock:
                found = self._budgets.setdefault(device, found)
        return found

    def reserve(self, device: Device, nbytes: int) -> Reservation:
        """Hold ``nbytes`` of ``device``'s budget.

        Raises
        ------
        InsufficientSpace
            Over the budget; the message and details say how much is free.
        """
        limit = self.budget(device)
        with self._lock:
            used = self._used.get(device, 0)
            if used + nbytes > limit:
                free = max(0, limit - used)
                raise InsufficientSpace(
                    f"{device}: {nbytes} bytes needed, {free} of the {limit} byte lease budget "
                    "free; release or let expire some buffers",
                    device=str(device),
                    requested=nbytes,
                    free=free,
                    budget=limit,
                )
            self._used[device] = used + nbytes
            room = limit - used - nbytes
        # Leased plus idle stays within the budget: drop idle buffers the new one needs.
        self.pool.trim(device, keep=room)
        return Reservation(self, device, nbytes)

    def _unreserve(self, device: Device, nbytes: int) -> None:
        with self._lock:
            self._used[device] = self._used.get(device, 0) - nbytes

    def leased_bytes(self) -> dict[str, int]:
        """Bytes held (leases and reservations in progress) per device seen so far."""
        with self._lock:
            return {str(d): n for d, n in self._used.items()}

    def budgets(self) -> dict[str, int]:
        with self._lock:
            return {str(d): n for d, n in self._budgets.items()}

    # -- leases ------------------------------------------------------------------------------
    def ttl(self, ttl_s: float | None) -> float:
        """A requested TTL, checked; ``None`` gives the default."""
        if ttl_s is None:
            return self.ttl_s
        if not 0 < ttl_s <= self.max_ttl_s:
            raise InvalidInput(
                f"ttl_s must be in (0, {self.max_ttl_s}], got {ttl_s}", max_ttl_s=self.max_ttl_s
            )
        return float(ttl_s)

    def _new(
        self, buf: DeviceBuffer, holding: Holding, spec: LeaseSpec, *, read_only: bool, reused: bool
    ) -> Lease:
        ttl = self.ttl(spec.ttl_s)
        now = self._clock()
        return Lease(
            id=secrets.token_hex(12),
            device=buf.device,
            buffer=buf,
            nbytes=spec.nbytes,
            dtype=spec.dtype,
            shape=spec.shape,
            created_at=now,
            expires_at=now + ttl,
            ttl_s=ttl,
            kind=spec.kind,
            file_ids=spec.file_ids,
            report=spec.report,
            offset=spec.offset,
            tensors=spec.tensors or {},
            read_only=read_only,
            reused=reused,
            holding=holding,
        )

    def grant(self, reservation: Reservation, spec: LeaseSpec, *, read_only: bool = False) -> Lease:
        """Turn a reservation with its attached buffer into a lease of ``spec``.

        A ``read_only`` lease's buffer may be handed out again by :meth:`share`.
        """
        buf = reservation.buffer
        if buf is None:
            raise InvalidInput("no buffer attached to the reservation")
        if buf.alloc_bytes != reservation.nbytes:
            raise InvalidInput("buffer size differs from the bytes reserved for it")
        lease = self._new(buf, Holding(buf), spec, read_only=read_only, reused=False)
        reservation._granted()
        with self._lock:
            self._leases[lease.id] = lease
        return lease

    def share(self, holding: Holding, spec: LeaseSpec) -> Lease | None:
        """A new read-only lease of ``spec`` over a buffer others hold already; nothing is
        reserved or allocated (the bytes are charged once, to the holding). None when its
        last holder has let go meanwhile (the caller then loads afresh)."""
        buf = holding.buffer
        if spec.offset < 0 or spec.offset + spec.nbytes > buf.alloc_bytes:
            raise InvalidInput(
                f"[{spec.offset}, {spec.offset + spec.nbytes}) is outside the allocation"
            )
        lease = self._new(buf, holding, spec, read_only=True, reused=True)
        with self._lock:
            if holding.count <= 0:
                return None
            holding.count += 1
            self._leases[lease.id] = lease
        return lease

    def hold(self, holding: Holding) -> bool:
        """Pin a held buffer (a load copying from it) until :meth:`unhold`; False when its
        last holder has let go already."""
        with self._lock:
            if holding.count <= 0:
                return False
            holding.count += 1
            return True

    def unhold(self, holding: Holding) -> None:
        """Undo one :meth:`hold`."""
        self._unref(holding)

    def watch(self, holding: Holding, on_last: Callable[[Holding], None]) -> bool:
        """Call ``on_last(holding)`` when its last holder lets go, before the buffer is freed
        or pooled; False (and never called) when that has happened already."""
        with self._lock:
            if holding.count <= 0:
                return False
            holding.on_last = on_last
            return True

    def get(self, lease_id: str) -> Lease:
        with self._lock:
            lease = self._leases.get(lease_id)
        if lease is None:
            raise BufferNotFound(f"no buffer with id {lease_id!r}", buffer_id=lease_id)
        return lease

    def all(self) -> list[Lease]:
        with self._lock:
            return sorted(self._leases.values(), key=lambda lease: lease.created_at)

    def renew(self, lease_id: str, ttl_s: float | None = None) -> Lease:
        """Restart a lease's TTL (``ttl_s``, default the lease's own)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise BufferNotFound(f"no buffer with id {lease_id!r}", buffer_id=lease_id)
            ttl = lease.ttl_s if ttl_s is None else self.ttl(ttl_s)
            lease.ttl_s = ttl
            lease.expires_at = self._clock() + ttl
            return lease

    def release(self, lease_id: str) -> Lease:
        """Free a lease now."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise BufferNotFound(f"no buffer with id {lease_id!r}", buffer_id=lease_id)
        self._free(lease)
        return lease

    def release_many(self, lease_ids: Iterable[str]) -> None:
        """Free those of ``lease_ids`` that still exist."""
        with self._lock:
            gone = [self._leases.pop(i) for i in set(lease_ids) if i in self._leases]
        for lease in gone:
            self._free(lease)

    def _free(self, lease: Lease) -> None:
        if lease.holding is None:  # not granted by this table: it holds the buffer alone
            lease.holding = Holding(lease.buffer)
        self._unref(lease.holding)

    def _unref(self, holding: Holding) -> None:
        with self._lock:
            holding.count -= 1
            if holding.count > 0:
                return
            on_last, holding.on_last = holding.on_last, None
        buf = holding.buffer
        try:
            if on_last is not None:
                try:
                    on_last(holding)  # before the pool can hand the buffer to another load
                except Exception:
                    log.exception("dropping the resident copy in %s failed", buf.device)
            self.pool.put(buf)
        finally:
            self._unreserve(buf.device, buf.alloc_bytes)

    def reap(self, now: float | None = None) -> int:
        """Free every expired lease; returns how many."""
        now = self._clock() if now is None else now
        with self._lock:
            expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
            for lease in expired:
                del self._leases[lease.id]
            self.expired_total += len(expired)
        for lease in expired:
            try:
                self._free(lease)
            except Exception:
                log.exception("freeing expired buffer %s failed", lease.id)
        self.pool.expire()
        return len(expired)

    def free_all(self) -> int:
        with self._lock:
            leases = list(self._leases.values())
            self._leases.clear()
        for lease in leases:
            try:
                self._free(lease)
            except Exception:
                log.exception("freeing buffer %s failed", lease.id)
        return len(leases)

    # -- reaper ------------------------------------------------------------------------------
    def start(self) -> None:
        self._reaper.start()

    def stop(self) -> None:
        """Stop the reaper and free every lease."""
        self._reaper.stop()
        freed = self.free_all()
        self.pool.clear()
        if freed:
            log.info("freed %d buffer lease(s) at shutdown", freed)

    def _reap_and_log(self) -> None:
        n = self.reap()
        if n:
            log.info("freed %d expired buffer lease(s)", n)
