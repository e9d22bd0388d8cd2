"""Torch state dicts over leased buffers: exact dtypes, no copy, leases kept while tensors live.

What holds the memory
---------------------
``torch.from_dlpack(array)`` gives a tensor whose storage keeps ``array`` alive (the DLPack
capsule's deleter owns a reference to it), and everything made from the tensor without a copy
(``.view(dtype)``, slices, an ``nn.Parameter`` from ``load_state_dict(..., assign=True)``)
shares that storage. Each array handed to torch here owns its memory through a :class:`_Hold`
(NumPy's ``base``, CuPy's ``UnownedMemory`` owner), which references the lease's mapping and
the load's :class:`_Keep`. So the ``_Keep`` of a load dies exactly when the last storage over
any of its tensors is freed, however the tensors were viewed, wrapped or passed around; its
``weakref.finalize`` then retires the load's leases.

Why renew
---------
A lease lives ``ttl_s`` seconds unless renewed. On ``cuda``, an expired or released lease's
allocation goes back to the service's pool and the next load of that size reuses it: tensors
still viewing it would silently read someone else's bytes. (On ``cpu`` the mapping keeps its
pages, but the service would count the bytes free.) So one thread per client renews every live
load's leases at a third of their TTL, so that two renewals can fail before one expires, and
releases them once their tensors are gone. The thread runs only while some load is alive, and
:meth:`Client.close` stops it, releasing what is left.

The finalizer may run in any thread, inside the garbage collector too, so all it does is put a
message on a :class:`queue.SimpleQueue` (whose ``put`` is reentrant); the HTTP calls happen on
the renewer's thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tiering.io.safetensors import DTYPES, convert

from ._buffers import Buffer, Tensors
from ._exceptions import NotFound
from ._loads import model_body, open_tensors, parse_target, safetensors_body

if TYPE_CHECKING:
    import torch

__all__ = ["StateDictSource", "close_client", "load_state_dict"]

log = logging.getLogger("tierd_client")

StateDictSource = str | int | Sequence[str | int]
"""A model name (``models/all-MiniLM-L6-v2``), or safetensors files: one relpath ending in
``.safetensors``, a catalog id, or a list of either."""


class _Client(Protocol):
    """What a state dict needs of its client (a :class:`Client`)."""

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
    ) -> Any: ...

    def _open_all(self, reply: Mapping[str, Any], wait: bool = True) -> list[Buffer]: ...

    def renew(self, buffer_id: str, ttl_s: float | None = None) -> dict[str, Any]: ...

    def release(self, buffer_id: str) -> dict[str, Any]: ...


def load_state_dict(
    client: _Client,
    model: StateDictSource,
    *,
    device: str = "cpu",
    names: Sequence[str] | None = None,
    prefix: str | None = None,
    ttl_s: float | None = None,
    shared: bool = False,
) -> dict[str, torch.Tensor]:
    """Load a model's tensors as ``{name: torch.Tensor}``; see :meth:`Client.load_state_dict`."""
    try:
        import torch  # noqa: F401  (checked before anything is leased)
    except ImportError as exc:
        raise ImportError("load_state_dict needs torch: pip install torch") from exc
    target = parse_target(device)
    if isinstance(model, str) and not model.endswith(".safetensors"):
        body = model_body(names, prefix, target, ttl_s, shared)
        reply = client.request("POST", "/v1/models/load", params={"name": model}, json=body)
    elif prefix is not None:
        raise TypeError("prefix selects tensors of a model by name; with files, give names")
    else:
        body = safetensors_body(model, names, target, ttl_s, shared)
        reply = client.request("POST", "/v1/load/safetensors", json=body)
    # Opened without waiting: the buffers' views and the torch tensors are made while the
    # server's copies of bytes held in memory still run, and waited for last.
    tensors = open_tensors(client, target, reply, wait=False)
    assert isinstance(tensors, Tensors)
    try:
        out = _wrap(client, tensors)
    except BaseException:
        tensors.close()
        raise
    try:
        tensors.wait()
    except BaseException:
        out.clear()  # the keeper releases the leases once the tensors are gone
        raise
    # The arrays made from the buffers keep the mappings; the leases are the keeper's now.
    for b in tensors.buffers:
        b.close(release=False)
    return out


def _wrap(client: _Client, tensors: Tensors) -> dict[str, torch.Tensor]:
    ids = [b.id for b in tensors.buffers]
    ttl = min((float(b.info.get("ttl_s", 0) or 0) for b in tensors.buffers), default=0.0)
    keep = _Keep()
    out: dict[str, torch.Tensor] = {}
    wholes: dict[tuple[str, str], torch.Tensor] = {}
    for name in tensors:
        if tensors.nbytes[name] == 0:  # nothing to share, and no lease needed
            out[name] = convert(_empty(tensors[name]), tensors.dtypes[name], "torch")
        else:
            out[name] = _tensor(tensors, name, keep, wholes)
    _renewer(client).add(_Group(client, ids, ttl), keep)
    return out


def _tensor(
    tensors: Tensors, name: str, keep: _Keep, wholes: dict[tuple[str, str], torch.Tensor]
) -> torch.Tensor:
    """Tensor ``name`` as a strided view of its buffer, made one torch tensor per dtype once
    (``wholes``): a DLPack export costs several times a view, and a checkpoint has hundreds of
    tensors (300 of them took 8.6 ms one export each, 4.0 ms as views of one, on the 2-core
    machine), and without the buffer's array of each tensor, which cost as much again. A
    tensor whose offset is not a whole number of its items, or whose dtype this torch lacks,
    gets its own export."""
    import torch
    from torch.utils.dlpack import from_dlpack  # what torch re-exports as torch.from_dlpack

    buf, offset = tensors.locations[name]
    spec = DTYPES[tensors.dtypes[name]]
    dt = getattr(torch, spec.exact or spec.storage, None)
    size = np.dtype(spec.storage).itemsize
    if dt is None or offset % size:
        one: torch.Tensor = convert(_held(tensors[name], keep), tensors.dtypes[name], "torch")
        return one
    whole = wholes.get((buf.id, str(dt)))
    if whole is None:
        n = buf.nbytes - buf.nbytes % size
        flat = buf.view(0, n, np.uint8, (n,))
        whole = wholes[buf.id, str(dt)] = from_dlpack(_held(flat, keep)).view(dt)
    shape = tensors.shapes[name]
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return torch.as_strided(whole, shape, tuple(reversed(strides)), offset // size)


def _empty(arr: Any) -> Any:
    if isinstance(arr, np.ndarray):
        return np.empty(arr.shape, arr.dtype)
    import cupy as cp

    with cp.cuda.Device(arr.device.id):
        return cp.empty(arr.shape, arr.dtype)


class _Keep:
    """One load's lifetime token: referenced by every tensor's memory, finalized with the last."""

    __slots__ = ("__weakref__",)


class _Hold:
    """Owner of one tensor's memory: the lease's mapping (``array``) and the load's ``keep``."""

    __slots__ = ("__array_interface__", "array", "keep")

    def __init__(self, array: Any, keep: _Keep) -> None:
        self.array = array
        self.keep = keep
        if isinstance(array, np.ndarray):
            # Writable even over a read-only (shared) buffer: torch has no read-only tensors,
            # so the flag would only make a torch older than DLPack 1.0 refuse the export.
            ai = array.__array_interface__
            self.__array_interface__ = {**ai, "data": (ai["data"][0], False)}


def _held(arr: Any, keep: _Keep) -> Any:
    """An array over ``arr``'s memory whose owner is a :class:`_Hold` (no copy)."""
    hold = _Hold(arr, keep)
    if isinstance(arr, np.ndarray):
        return np.asarray(hold)  # an array whose ``base`` is ``hold``
    import cupy as cp

    mem = cp.cuda.UnownedMemory(arr.data.ptr, arr.nbytes, hold, device_id=arr.device.id)
    return cp.ndarray(arr.shape, arr.dtype, cp.cuda.MemoryPointer(mem, 0))


# -- leases: renewal while the tensors live, release after ------------------------------------


@dataclass(eq=False)
class _Group:
    """The leases of one load."""

    client: _Client
    ids: list[str]
    ttl_s: float
    due: float = 0.0
    key: int = field(default_factory=itertools.count().__next__)
    #: When renewals began to fail (None: the last one worked).
    failing_since: float | None = None

    @property
    def period(self) -> float:
        # A third of the TTL: two renewals may fail (a slow or restarting server) before the
        # lease expires. Never busier than 20 a second, whatever TTL was asked for.
        return max(self.ttl_s / 3, 0.05)


class _Renewer:
    """One client's renewal thread, and the messages that drive it."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._life = threading.Lock()
        self._thread: threading.Thread | None = None
        self._live: dict[int, _Group] = {}  # touched by the thread alone

    def add(self, group: _Group, keep: _Keep) -> None:
        finalizer = weakref.finalize(keep, self._q.put, ("retire", group.key))
        # At interpreter exit the thread is gone: the service frees the leases at their TTL.
        finalizer.atexit = False
        group.due = time.monotonic() + group.period
        self._q.put(("add", group))
        with self._life:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="tierd-lease-renewer", daemon=True
                )
                self._thread.start()

    def close(self) -> None:
        """Release every live load's leases and stop the thread."""
        with self._life:
            thread = self._thread
        if thread is None:
            return
        self._q.put(("stop", None))
        thread.join()

    def _run(self) -> None:
        live = self._live
        while True:
            if not live:
                with self._life:
                    if self._q.empty():
                        self._thread = None
                        return
            timeout = None
            if live:
                timeout = max(0.0, min(g.due for g in live.values()) - time.monotonic())
            try:
                kind, arg = self._q.get(timeout=timeout)
            except queue.Empty:
                kind, arg = "tick", None
            if kind == "add":
                live[arg.key] = arg
            elif kind == "retire":
                group = live.pop(arg, None)
                if group is not None:
                    _release(group)
            elif kind == "stop":
                for group in list(live.values()):
                    if group.ids:
                        log.warning(
                            "client closed while a state dict's tensors are alive: its %d "
                            "lease(s) are released (on cuda the service may reuse the memory)",
                            len(group.ids),
                        )
                    _release(group)
                live.clear()
                with self._life:
                    self._thread = None
                return
            now = time.monotonic()
            for group in list(live.values()):
                if group.due <= now:
                    _renew(group)
                    group.due = time.monotonic() + group.period
                    if not group.ids:
                        del live[group.key]  # nothing left to renew or release


def _renew(group: _Group) -> None:
    failed: list[str] = []
    for lease in list(group.ids):
        try:
            group.client.renew(lease)
        except NotFound:
            log.warning(
                "lease %s expired while tensors still view it; on cuda its memory may be reused",
                lease,
            )
            group.ids.remove(lease)
        except Exception as exc:  # the thread must outlive one failed call: retry next period
            log.warning("renewing lease %s failed (retrying): %s", lease, exc)
            failed.append(lease)
    now = time.monotonic()
    if not failed:
        group.failing_since = None
    elif group.failing_since is None:
        group.failing_since = now
    elif now - group.failing_since >= group.ttl_s:
        # Unanswered for a whole TTL: the service has freed them (or is gone). Retrying for
        # ever would only log for ever, past the life of the service and of its caller.
        log.warning(
            "giving up on %d lease(s) unrenewed for %.1f s, past their TTL: the service has "
            "freed them; on cuda their memory may be reused",
            len(failed),
            now - group.failing_since,
        )
        group.ids = [lease for lease in group.ids if lease not in failed]


def _release(group: _Group) -> None:
    for lease in group.ids:
        try:
            group.client.release(lease)
        except NotFound:
            pass  # expired already
        except Exception as exc:  # the service frees it at its TTL anyway
            log.warning("releasing lease %s failed (it expires by itself): %s", lease, exc)
    group.ids = []


_renewers: weakref.WeakKeyDictionary[Any, _Renewer] = weakref.WeakKeyDictionary()
_renewers_lock = threading.Lock()


def _renewer(client: _Client) -> _Renewer:
    with _renewers_lock:
        r = _renewers.get(client)
        if r is None:
            r = _renewers[client] = _Renewer()
        return r


def close_client(client: object) -> None:
    """Stop renewing ``client``'s state dicts and release their leases (from ``close``)."""
    with _renewers_lock:
        r = _renewers.pop(client, None)
    if r is not None:
        r.close()
