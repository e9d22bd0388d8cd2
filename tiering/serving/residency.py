"""GPU residency: the read-only copies tierd holds in device (and shared) memory, found by
content, handed out again and copied from.

Kept whole past 450 lines: finding, handing out and letting go of copies share one lock and
one table, so splitting them would hand that lock across modules.

A lease's buffer is normally the client's to write (a trainer may update embedding rows in
place), so tierd cannot serve another load from it: its bytes may no longer be the file's.
Only **read-only** buffers are resident copies: those of loads with ``shared=true`` (the caller
promises never to write them) and those of GPU prefetches. Each is an :class:`Entry` of the
:class:`Residency`, named by a :class:`ResidentKey`: the file's id and catalog generation, the
device, and what of the file it holds (a byte range, or a selection of safetensors tensors).
An entry also keeps the :class:`~tiering.tiers.Stat` of the authoritative file, taken
*before* its bytes were read, so a file rewritten behind tierd's back (same size, new bytes)
fails :func:`~tiering.serving.held.still_current` and is never served from the copy.

The residency serves loads two ways:

- **shared loads** (:meth:`Residency.find`, :meth:`Residency.grant_shared`): a load with
  ``shared=true`` whose content is resident on its device gets a new lease over the *same
  allocation* (same CUDA IPC handle or shared-memory segment, at an offset for a range
  inside a resident range): no new device bytes, no copy, no read. Concurrent shared loads of
  one content wait for the first to fill it (:meth:`Residency.claim`), so N processes started
  together still read and hold one copy.
- **copies** (:meth:`Residency.acquire`, the :class:`~tiering.serving.held.Holder` of the
  loader): any load of a file resident *whole* on a GPU copies it device → device on that
  GPU (source ``gpu``), over NVLink/PCIe from another GPU where peer access is possible
  (``peer``), or device → host for a ``cpu`` target; the load's own buffer stays its own.

**A copy outlives its last lease**: the residency keeps its buffer itself
(:meth:`~tiering.serving.leases.LeaseTable.keep`), so a serving process that restarts finds
its weights still on the GPU. A kept copy no lease holds is tierd's own (never written, never
pooled) and goes: least recently used first past the device's budget (``keep``:
``gpu_resident_bytes``; 0 keeps nothing); at once when a reservation needs its room
(:meth:`Residency.make_room`); when its file changes or is deleted (found stale by a load, or
by :meth:`Residency.sweep` on the lease reaper's tick). A copy some lease holds is never taken
from it: a stale one is forgotten, and its leases keep the bytes they were given. An entry is
dropped before its buffer can go back to the pool.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from tiering.catalog import FileRecord
from tiering.io import Device, IoReport, LoadSource, Stats, peer_access
from tiering.io.safetensors import TensorInfo
from tiering.serving.held import Held, authoritative_stat
from tiering.serving.leases import Holding, Lease, LeaseSpec, LeaseTable
from tiering.serving.resident import Claims, Entry, ResidentKey
from tiering.tiers import Stat, Tier

__all__ = ["Entry", "Residency", "ResidentKey", "authoritative_stat"]

log = logging.getLogger(__name__)

_SWEEP_S = 2.0  # the longest a kept copy of a changed file outlives the change, unused


class Residency:
    """The resident copies of one loader, by content; see the module docstring.

    Parameters
    ----------
    leases:
        The lease table whose read-only buffers the entries are.
    stats:
        Where a lease granted over a resident copy is counted (the ``copy`` path, 0 bytes).
    on_access:
        ``on_access(file_id)``: count one access of a file served from a copy.
    keep:
        ``keep(device)``: the most bytes of copies no lease holds that ``device`` keeps
        (0: a copy goes with its last lease).
    generation:
        ``generation(file_id)``: the file's catalog generation now, None when it is gone
        (for :meth:`sweep`; it may raise when the catalog cannot say).
    """

    def __init__(
        self,
        leases: LeaseTable,
        stats: Stats,
        on_access: Callable[[int], None],
        *,
        keep: Callable[[Device], int] = lambda _device: 0,
        generation: Callable[[int], int | None] | None = None,
    ) -> None:
        self._leases = leases
        self._stats = stats
        self._on_access = on_access
        self._keep = keep
        self._generation = generation
        self._closed = False
        self._ticks = itertools.count(1)
        self._swept = 0.0
        leases.reclaim = leases.pool.on_short = self.make_room
        leases.on_reap = self._tick
        self._lock = threading.Lock()
        self._entries: dict[ResidentKey, Entry] = {}
        self._by_file: dict[int, list[Entry]] = {}
        self._by_holding: dict[int, Entry] = {}
        self._claims = Claims()

    def claim(self, keys: Iterable[ResidentKey]) -> contextlib.AbstractContextManager[None]:
        """Hold ``keys`` against other shared loads until the block ends (see
        :class:`~tiering.serving.resident.Claims`)."""
        return self._claims.claim(keys)

    # -- finding copies ------------------------------------------------------------------------
    @staticmethod
    def whole(rec: FileRecord, device: Device) -> ResidentKey:
        """The key of the whole file on ``device``."""
        return ResidentKey.bytes(rec, device, 0, rec.size)

    @staticmethod
    def stat_now(rec: FileRecord, tier: Tier) -> Stat | None:
        """:func:`authoritative_stat`: take it before reading what becomes a copy."""
        return authoritative_stat(rec, tier)

    def find(self, key: ResidentKey, rec: FileRecord, tier: Tier) -> Entry | None:
        """The current entry of exactly ``key``; a stale one is forgotten."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.current(rec, tier):
            self._touch(entry)
            return entry
        self._forget(entry)
        return None

    def find_range(
        self,
        rec: FileRecord,
        device: Device,
        offset: int,
        length: int,
        itemsize: int,
        tier: Tier,
    ) -> tuple[Entry, int] | None:
        """A current entry on ``device`` holding bytes ``[offset, offset + length)`` of the
        file, and where they start in it: the exact range, else a resident range around it
        whose start lies a whole number of items before (so the data stays aligned)."""
        exact = self.find(ResidentKey.bytes(rec, device, offset, length), rec, tier)
        if exact is not None:
            return exact, 0
        for e in self._on(rec, device):
            at = e.covers(offset, length)
            if at is None or at % max(1, itemsize):
                continue
            if e.current(rec, tier):
                self._touch(e)
                return e, at
            self._forget(e)
        return None

    def find_tensors(
        self, key: ResidentKey, rec: FileRecord, tier: Tier, tensors: Iterable[TensorInfo]
    ) -> tuple[Entry, dict[str, Any]] | None:
        """A current entry on ``key``'s device holding every one of ``tensors`` of the file,
        and their layout in it: the exact selection (``key``), else any copy of the file's
        bytes around them (the whole file, another selection read in one span)."""
        wanted = list(tensors)
        exact = self.find(key, rec, tier)
        if exact is not None:
            return exact, exact.tensors
        for e in self._on(rec, key.device):
            layout = e.layout(wanted)
            if layout is None:
                continue
            if e.current(rec, tier):
                self._touch(e)
                return e, layout
            self._forget(e)
        return None

    def _on(self, rec: FileRecord, device: Device) -> list[Entry]:
        """The entries of ``rec``'s generation on ``device``, whole copies first."""
        with self._lock:
            same = [
                e
                for e in self._by_file.get(rec.id, ())
                if e.device == device and e.key.generation == rec.generation
            ]
        return sorted(same, key=lambda e: not e.whole(rec))

    # -- leases over copies ----------------------------------------------------------------------
    def grant_shared(
        self,
        entry: Entry,
        rec: FileRecord,
        *,
        kind: str,
        ttl_s: float | None,
        offset: int = 0,
        nbytes: int | None = None,
        dtype: str = "uint8",
        shape: tuple[int, ...] | None = None,
        tensors: dict[str, Any] | None = None,
    ) -> Lease | None:
        """A new lease over ``entry``'s allocation (no read, no copy, no new bytes), naming
        ``tensors`` (by default the entry's); see :meth:`share`. None when the entry's last
        holder let go meanwhile (load afresh)."""
        n = entry.nbytes if nbytes is None else nbytes
        return self.share(
            entry.holding,
            rec,
            kind=kind,
            ttl_s=ttl_s,
            offset=offset,
            nbytes=n,
            dtype=dtype,
            shape=shape,
            tensors=entry.tensors if tensors is None else tensors,
        )

    def share(
        self,
        holding: Holding,
        rec: FileRecord,
        *,
        kind: str,
        ttl_s: float | None,
        offset: int,
        nbytes: int,
        dtype: str = "uint8",
        shape: tuple[int, ...] | None = None,
        tensors: dict[str, Any] | None = None,
    ) -> Lease | None:
        """A new read-only lease of ``nbytes`` at ``offset`` of a held read-only buffer,
        counted as one access of ``rec`` and one 0-byte operation under the ``copy`` path (its
        report says so: no byte was read for it). None when its last holder let go."""
        started = time.perf_counter()
        spec = LeaseSpec(
            nbytes,
            dtype,
            shape if shape is not None else (nbytes,),
            kind,
            (rec.id,),
            ttl_s=ttl_s,
            offset=offset,
            tensors=tensors,
        )
        lease = self._leases.share(holding, spec)
        if lease is None:
            return None
        # The bytes were in memory already: on the GPU, or in host (shared) memory.
        source: LoadSource = "gpu" if lease.device.is_cuda else "memory"
        begun = self._stats.begin("copy", rec.tier, source)
        self._stats.end("copy", rec.tier, begun, 0, True, source)
        lease.report = IoReport(0, "copy", rec.tier, time.perf_counter() - started, source=source)
        self._on_access(rec.id)
        return lease

    def register(
        self,
        key: ResidentKey,
        lease: Lease,
        stat: Stat,
        *,
        base: int | None = None,
        head: bytes | None = None,
    ) -> Entry | None:
        """Make ``lease``'s read-only buffer the resident copy of ``key`` (replacing an older
        entry of that key). A copy of tensors says where it lies in the file, when it is one
        run of its bytes: ``base``, and the ``head`` before it where it runs to the end (see
        :class:`Entry`), so that it serves other loads of the file too. None when its leases
        are gone already."""
        holding = lease.holding
        if holding is None or not lease.read_only:
            return None
        # Kept before it is indexed: a load that finds the entry stale meanwhile lets it go
        # again, so no kept buffer is ever left without an entry.
        if not self._closed and self._keep(key.device) > 0:
            self._leases.keep(holding, self._idle)
        entry = Entry(key, holding, stat, lease.nbytes, dict(lease.tensors))
        if key.what[0] == "tensors":
            entry.base, entry.head = base, head
        with self._lock:
            old = self._entries.get(key)
            if old is not None:
                self._unindex(old)
            self._entries[key] = entry
            self._by_file.setdefault(key.file_id, []).append(entry)
            self._by_holding[id(holding)] = entry
            entry.used = next(self._ticks)
        if old is not None:
            self._let_go(old)
        # Watched only once indexed: were the leases gone in between, no callback would come
        # to drop it, so it is dropped here (and after close, which kept nothing more).
        if not self._leases.watch(holding, self._dropped) or self._closed:
            self._forget(entry)
            return None
        return entry

    # -- the Holder of serving.held --------------------------------------------------------------
    def acquire(self, rec: FileRecord, device: Device) -> Held | None:
        """A copy of the whole file for a read into ``device``, pinned until released: one on
        ``device`` itself, else one on a GPU that ``device`` can read directly (peer access),
        else, for a ``cpu`` target, any; None when there is none. Whole is every byte, a
        shard's tensors with the header their load read (see :class:`Entry`): whatever load
        made the copy, any load of the file copies from it."""
        with self._lock:
            found = [
                e
                for e in self._by_file.get(rec.id, ())
                if (e.device.is_cuda or not device.is_cuda)
                and e.key.generation == rec.generation
                and e.whole(rec)
            ]
        if not found:
            return None
        order = [e for e in found if e.device == device]
        others = [e for e in found if e.device != device]
        if device.is_cuda:
            order += [e for e in others if _peer(device.index, e.device.index)]
        else:
            order += others
        for e in order:
            if self._leases.hold(e.holding):
                self._touch(e)
                return Held(
                    file_id=rec.id,
                    generation=e.key.generation,
                    stat=e.stat,
                    array=e.holding.buffer.array()[: e.nbytes],
                    held_on=e.device,
                    holder="gpu",
                    head=e.head or b"",
                    _release=functools.partial(self._leases.unhold, e.holding),
                )
        return None

    # -- bookkeeping -----------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of the resident copies per device (allocations, as the budget counts them)."""
        out: dict[str, int] = {}
        for e in self.entries():
            dev = str(e.device)
            out[dev] = out.get(dev, 0) + e.holding.buffer.alloc_bytes
        return out

    def copies(self) -> dict[str, int]:
        """How many resident copies each device holds."""
        out: dict[str, int] = {}
        for e in self.entries():
            out[str(e.device)] = out.get(str(e.device), 0) + 1
        return out

    def kept_bytes(self) -> dict[str, int]:
        """Bytes of the copies no lease holds (kept by tierd alone), per device."""
        return self._leases.kept_bytes()

    # -- the policy ------------------------------------------------------------------------------
    def make_room(self, device: Device, nbytes: int) -> int:
        """Let kept copies of ``device`` no lease holds go, least recently used first, until
        ``nbytes`` are freed or none is left; returns the bytes freed. Asked when a reservation
        would not fit the budget, or a GPU allocation the device itself (the pool)."""
        freed = 0
        while freed < nbytes and (n := self._let_go_oldest(device)):
            freed += n
        return freed

    def sweep(self) -> int:
        """Forget the copies no lease holds whose file changed or is gone since (the reaper
        calls it each tick); returns how many. A catalog that cannot answer keeps them: a
        load still checks a copy before it uses it."""
        if self._generation is None:
            return 0
        gone = 0
        for e in self.entries():
            if not e.holding.idle:
                continue  # a copy in use is checked by the load that finds it
            try:
                now = self._generation(e.key.file_id)
            except Exception as exc:
                log.debug("residency sweep skipped: %s", exc)
                return gone
            if now != e.key.generation:
                self._forget(e)
                gone += 1
        return gone

    def _tick(self) -> None:
        # The reaper's tick: an uncached catalog (PostgreSQL) is asked once per kept copy.
        now = time.monotonic()
        if now - self._swept >= _SWEEP_S:
            self._swept = now
            self.sweep()

    def close(self) -> None:
        """Keep nothing more, and let every kept copy go (with its leases, if any)."""
        self._closed = True
        for e in self.entries():
            self._forget(e)

    def _idle(self, holding: Holding) -> None:
        # The lease table: a kept copy's last lease let go. Keep the device within its budget.
        device = holding.buffer.device
        limit = 0 if self._closed else self._keep(device)
        self.make_room(device, self._leases.kept_bytes().get(str(device), 0) - limit)

    def _let_go_oldest(self, device: Device) -> int:
        """Let the least recently used kept copy of ``device`` no lease holds go; its bytes,
        0 when there is none."""
        with self._lock:
            idle = sorted(
                (e for e in self._entries.values() if e.device == device and e.holding.idle),
                key=lambda e: e.used,
            )
        for e in idle:
            # Only if still idle: a load that took it meanwhile keeps it.
            if self._leases.unkeep(e.holding, only_idle=True):
                return e.holding.buffer.alloc_bytes
        return 0

    def _touch(self, entry: Entry) -> None:
        with self._lock:
            entry.used = next(self._ticks)

    def _let_go(self, entry: Entry) -> None:
        """Stop keeping ``entry``'s buffer (unindexed already) unless another entry names it."""
        with self._lock:
            named = id(entry.holding) in self._by_holding
        if not named:
            self._leases.unkeep(entry.holding)

    def _dropped(self, holding: Holding) -> None:
        with self._lock:
            entry = self._by_holding.get(id(holding))
            if entry is not None and entry.holding is holding:
                self._unindex(entry)

    def _forget(self, entry: Entry) -> None:
        with self._lock:
            self._unindex(entry)
        self._let_go(entry)

    def _unindex(self, entry: Entry) -> None:
        # Under self._lock.
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        same = self._by_file.get(entry.key.file_id)
        if same is not None:
            same[:] = [e for e in same if e is not entry]
            if not same:
                del self._by_file[entry.key.file_id]
        if self._by_holding.get(id(entry.holding)) is entry:
            del self._by_holding[id(entry.holding)]


def _peer(dst: int, src: int) -> bool:
    try:
        return peer_access(dst, src)
    except Exception as exc:  # a copy it cannot make is no reason to fail the load
        log.warning("peer access cuda:%d -> cuda:%d unavailable: %s", dst, src, exc)
        return False
