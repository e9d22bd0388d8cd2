"""Copies into GPU memory that land after the reply: a :class:`Fence` on the exporting side,
:func:`wait_ready` on the importing side.

A load whose bytes are already in memory (the memory tier's pinned copy, or a copy resident
on a GPU) is nothing but ``cudaMemcpyAsync`` calls. Waiting for them before the reply puts
every fixed cost of a REST load after the copy: the reply, the client's IPC opens, its tensor
views. A load made with a :class:`Fence` queues its copies and leaves the waiting to the
fence instead; :meth:`Fence.seal` records one interprocess CUDA event after them, and the
buffers' handles carry it (``ready_event``) until it has fired. The client opens its buffers
while the copies run, then waits on the event (:func:`wait_ready`), so the fixed costs hide
under the copy.

Only copies take part: any other read (KvikIO, ``preadv``, a remote GET) has landed by the
time it returns, fence or not. A fence that queued nothing has no event, and its buffers'
handles say nothing.

The exporting side also waits: one thread per process waits on every sealed fence, in order,
and then counts the copies as finished (their :class:`~tiering.io.Stats`, and what the
fence's :meth:`then` callbacks do); a buffer with a pending fence waits for it before its
memory is used for anything else (:meth:`~tiering.io.buffers.DeviceBuffer.settle`).
"""

from __future__ import annotations

import base64
import binascii
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tiering.errors import InvalidInput

from ._device import Device, gpu_uuid, import_cupy, local_device

__all__ = ["Fence", "wait_ready"]

log = logging.getLogger(__name__)

Finish = Callable[[bool], None]
"""What a queued copy does once it has landed (True) or failed (False): end its stats."""


class Fence:
    """The copies of one load into ``device``, queued and not yet waited for.

    Made by the caller of a load, handed down to the copies (see
    :func:`~tiering.io._copies.copy_into`), then :meth:`seal`-ed once every copy is queued.
    """

    def __init__(self, device: Device) -> None:
        if not device.is_cuda:
            raise InvalidInput(f"a fence is for copies into GPU memory, not {device}")
        self.device = device
        self._lock = threading.Lock()
        self._stream: Any = None
        self._finish: list[Finish] = []
        self._then: list[Callable[[Fence], None]] = []
        self._event: Any = None
        self._handle: dict[str, Any] | None = None
        self._landed = threading.Event()
        self._sealed = False
        self._started = 0.0
        #: Seconds from the first copy queued until the fence saw them all land.
        self.seconds: float | None = None

    def queued(self, stream: Any, finish: Finish) -> None:
        """A copy was queued on ``stream`` (the device's copy stream: every copy of one fence
        goes to the same one); ``finish`` runs once it has landed."""
        with self._lock:
            if self._sealed:
                raise RuntimeError("a copy was queued on a sealed fence")
            if self._stream is None:
                self._stream, self._started = stream, time.perf_counter()
            elif stream is not self._stream:
                raise RuntimeError("every copy of a fence goes to one stream")
            self._finish.append(finish)

    def seal(self) -> None:
        """No more copies: record the event after those queued, and start waiting for it in
        the background. With nothing queued the fence has landed already."""
        with self._lock:
            self._sealed = True
            if not self._finish:
                self.seconds = 0.0
                self._landed.set()
                return
        cp = import_cupy()
        with cp.cuda.Device(self.device.index):
            # Blocking: the waiting thread sleeps instead of spinning a core for the copy's
            # length. Interprocess events must not time (CUDA's rule).
            ev = cp.cuda.Event(block=True, disable_timing=True, interprocess=True)
            ev.record(self._stream)
            raw = bytes(cp.cuda.runtime.ipcGetEventHandle(ev.ptr))
        self._event = ev
        self._handle = {
            "kind": "cuda_ipc_event",
            "event_handle": base64.b64encode(raw).decode("ascii"),
            "device_index": self.device.index,
            "gpu_uuid": gpu_uuid(self.device.index),
        }
        _WAITER.put(self)

    @property
    def pending(self) -> bool:
        """Whether copies are queued that the fence has not seen land."""
        return not self._landed.is_set()

    def handle(self) -> dict[str, Any] | None:
        """The event another process waits on (``ready_event`` of a buffer's handle); None
        once the copies have landed, or before :meth:`seal`."""
        return self._handle if self.pending else None

    def then(self, fn: Callable[[Fence], None]) -> None:
        """Run ``fn(fence)`` once the copies have landed (now, if they have)."""
        with self._lock:
            if self.pending:
                self._then.append(fn)
                return
        fn(self)

    def wait(self) -> None:
        """Block until the copies have landed (the background thread's work, or anyone's who
        cannot go on before: a buffer about to be reused). Idempotent."""
        if not self.pending:
            return
        if not self._sealed:
            self.seal()  # a load that failed half-way: wait for what it did queue
            if not self.pending:
                return
        self._land()

    def _land(self) -> None:
        ok = True
        try:
            self._event.synchronize()
        except Exception:
            ok = False
            log.exception("copies of a load into %s failed", self.device)
        with self._lock:
            if not self.pending:
                return  # another waiter got here first
            self.seconds = time.perf_counter() - self._started
            finish, self._finish = self._finish, []
            then, self._then = self._then, []
            self._landed.set()
        for fn in finish:
            fn(ok)
        for cb in then:
            try:
                cb(self)
            except Exception:
                log.exception("a fence's callback failed")


class _Waiter:
    """One thread that waits on sealed fences in order (their copies share each device's copy
    stream, so they land in about the order they were queued). It runs only while fences are
    pending: it starts with the first one and ends once none is left, so nothing of it
    outlives the loads (a service that stops leaves no thread behind)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: collections.deque[Fence] = collections.deque()
        self._running = False

    def put(self, fence: Fence) -> None:
        with self._lock:
            self._pending.append(fence)
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._run, name="tierd-fences", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._running = False
                    return
                fence = self._pending.popleft()
            try:
                fence.wait()
            except Exception:
                log.exception("waiting on a fence failed")


_WAITER = _Waiter()


# -- the importing side -----------------------------------------------------------------------


def wait_ready(handles: Iterable[Mapping[str, Any]]) -> None:
    """Wait, in this process, until the bytes of every buffer handle have landed: each
    distinct ``ready_event`` is opened once, waited on and closed. Handles without one have
    landed already.

    Raises
    ------
    InvalidInput
        A malformed ``ready_event``.
    """
    seen: set[str] = set()
    for h in handles:
        ready = h.get("ready_event")
        if ready is None:
            continue
        try:
            key = str(ready["event_handle"])
            raw = base64.b64decode(key, validate=True)
            index = int(ready.get("device_index", 0))
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise InvalidInput(f"bad ready_event: {exc}") from exc
        if key in seen:
            continue
        seen.add(key)
        _wait_event(raw, index, ready.get("gpu_uuid"))


def _wait_event(raw: bytes, index: int, uuid: str | None) -> None:
    cp = import_cupy()
    rt = cp.cuda.runtime
    with cp.cuda.Device(local_device(index, uuid)):
        ev = rt.ipcOpenEventHandle(raw)
        try:
            rt.eventSynchronize(ev)
        finally:
            with contextlib.suppress(Exception):
                rt.eventDestroy(ev)
