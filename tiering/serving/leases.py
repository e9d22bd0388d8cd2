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

The residency may **keep** a holding (:meth:`LeaseTable.keep`): one more holder, tierd itself,
so the buffer outlives its last lease as a resident copy nobody writes. Such a copy no lease
holds is *kept*: its bytes stay charged to the budget but are not leased
(:meth:`LeaseTable.leased_bytes` leaves them out), and a reservation that would not fit asks
the residency (:attr:`LeaseTable.reclaim`) to let kept copies go before it fails.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType

from tiering.errors import BufferNotFound, InsufficientSpace, InvalidInput
from tiering.io import Device
from tiering.io.bufferpool import BufferPool
from tiering.io.buffers import DeviceBuffer
from tiering.periodic import Periodic
from tiering.serving.holding import Holding, Lease, LeaseSpec

__all__ = ["Holding", "Lease", "LeaseSpec", "LeaseTable", "Reservation"]

log = logging.getLogger(__name__)


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
        self._kept: dict[Device, int] = {}  # bytes of idle kept holdings, inside _used
        self._budgets: dict[Device, int] = {}
        self._reaper = Periodic(self._reap_and_log, reap_interval_s, "tierd-lease-reaper")
        self.expired_total = 0
        #: ``reclaim(device, nbytes)``: let kept copies of ``device`` go to free at least
        #: ``nbytes`` of its budget; returns the bytes freed (the residency sets it).
        self.reclaim: Callable[[Device, int], int] | None = None
        #: Called on every tick of the reaper (the residency's sweep of changed files).
        self.on_reap: Callable[[], object] | None = None

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
        """Hold ``nbytes`` of ``device``'s budget; kept resident copies are let go (least
        recently used first) for the room, never leases.

        Raises
        ------
        InsufficientSpace
            Over the budget; the message and details say how much is free (kept copies count
            as free: they would go for it).
        """
        limit = self.budget(device)
        while True:
            with self._lock:
                used = self._used.get(device, 0)
                kept = self._kept.get(device, 0)
                if used + nbytes <= limit:
                    self._used[device] = used + nbytes
                    room = limit - used - nbytes
                    break
                short = used + nbytes - limit
                # Only when letting every kept copy go would make room: a load that fails
                # anyway must not cost the others their copies.
                fits = used - kept + nbytes <= limit
            if not fits or self.reclaim is None or self.reclaim(device, short) <= 0:
                free = max(0, limit - used + kept)
                raise InsufficientSpace(
                    f"{device}: {nbytes} bytes needed, {free} of the {limit} byte lease budget "
                    "free; release or let expire some buffers",
                    device=str(device),
                    requested=nbytes,
                    free=free,
                    budget=limit,
                )
        # Leased plus idle stays within the budget: drop idle buffers the new one needs.
        self.pool.trim(device, keep=room)
        return Reservation(self, device, nbytes)

    def _unreserve(self, device: Device, nbytes: int) -> None:
        with self._lock:
            self._used[device] = self._used.get(device, 0) - nbytes

    def leased_bytes(self) -> dict[str, int]:
        """Bytes held (leases and reservations in progress) per device seen so far; not the
        resident copies kept after their last lease (see :meth:`kept_bytes`)."""
        with self._lock:
            return {str(d): n - self._kept.get(d, 0) for d, n in self._used.items()}

    def kept_bytes(self) -> dict[str, int]:
        """Bytes of resident copies no lease holds, per device (inside the budget)."""
        with self._lock:
            return {str(d): n for d, n in self._kept.items()}

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
            if not self._ref(holding):
                return None
            self._leases[lease.id] = lease
        return lease

    def hold(self, holding: Holding) -> bool:
        """Pin a held buffer (a load copying from it) until :meth:`unhold`; False when its
        last holder has let go already."""
        with self._lock:
            return self._ref(holding)

    def _ref(self, holding: Holding) -> bool:
        # Under self._lock.
        if holding.count <= 0:
            return False
        if holding.idle:
            self._kept_add(holding, -1)
        holding.count += 1
        return True

    def _kept_add(self, holding: Holding, sign: int) -> None:
        # Under self._lock.
        dev = holding.buffer.device
        self._kept[dev] = self._kept.get(dev, 0) + sign * holding.buffer.alloc_bytes

    def keep(self, holding: Holding, on_idle: Callable[[Holding], None]) -> bool:
        """Hold ``holding`` for tierd itself until :meth:`unkeep`, so its buffer outlives its
        last lease; ``on_idle(holding)`` is called each time no other holder is left. False
        when its last holder has let go already (or it is kept already)."""
        with self._lock:
            if holding.count <= 0 or holding.kept:
                return False
            holding.count += 1
            holding.kept = True
            holding.on_idle = on_idle
            return True

    def unkeep(self, holding: Holding, *, only_idle: bool = False) -> bool:
        """Undo :meth:`keep` (the buffer goes once its leases do); with ``only_idle``, only
        while no other holder is left, so a copy in use is never taken from its users.
        False when nothing was undone."""
        with self._lock:
            if not holding.kept or (only_idle and not holding.idle):
                return False
            if holding.idle:
                self._kept_add(holding, -1)
            holding.kept = False
            holding.on_idle = None
        self._unref(holding)
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
            idle = holding.on_idle if holding.idle else None
            if idle is not None:
                self._kept_add(holding, 1)
            alive = holding.count > 0
            on_last = None
            if not alive:
                on_last, holding.on_last = holding.on_last, None
        if alive:
            if idle is not None:
                try:
                    idle(holding)  # the residency's budget: it may let the copy go now
                except Exception:
                    log.exception("keeping the resident copy in %s failed", holding.buffer.device)
            return
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
        if self.on_reap is not None:
            self.on_reap()
