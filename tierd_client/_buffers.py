"""Leased buffers opened in this process: :class:`Buffer` and safetensors :class:`Tensors`.

A lease's handle (a CUDA IPC handle, or a POSIX shared-memory name) is opened by
:func:`tiering.io.buffers.attach`, which imports only numpy and the standard library; CuPy is
imported to open a ``cuda`` handle (ahead of the first, on a thread, where it is installed:
:func:`prewarm_cuda`), and torch only by :meth:`Tensors.torch`.

Read-only buffers (``shared=true`` loads and GPU prefetches: other processes may map the same
memory) say so wherever an interchange protocol can, and what enforces it differs:

- NumPy (``cpu``): the arrays, their views, ``__array_interface__`` (``data: (ptr, True)``)
  and ``memoryview`` are read-only; NumPy refuses writes.
- ``__cuda_array_interface__``: ``data: (ptr, True)``. ``torch.as_tensor`` refuses such an
  interface (TypeError: use ``torch.from_dlpack``); CuPy ignores the flag.
- ``__dlpack__`` for a DLPack 1.0 consumer: the ``READ_ONLY`` flag. NumPy honours it; torch
  and CuPy take the memory without a copy and ignore it (they have no read-only tensors).
- ``__dlpack__`` for an older consumer: the format cannot say it; nothing is enforced.

So a write through torch or CuPy is not stopped: it changes the bytes every process sharing
the buffer sees, and the resident copy tierd serves from. Don't.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from tiering.closing import Closing
from tiering.io.buffers import Attached, attach
from tiering.io.fences import wait_ready
from tiering.io.safetensors import DTYPES

from ._exceptions import NotFound, TierdClientError

__all__ = ["Buffer", "LeaseHolder", "Tensors"]


class LeaseHolder(Protocol):
    """What a buffer needs of its client: renew and release its lease (a :class:`Client`)."""

    def renew(self, buffer_id: str, ttl_s: float | None = None) -> dict[str, Any]: ...

    def release(self, buffer_id: str) -> dict[str, Any]: ...


class Buffer(Closing):
    """A leased buffer opened in this process.

    ``cuda`` buffers expose ``__cuda_array_interface__``, ``__dlpack__`` and
    ``__dlpack_device__`` (``torch.from_dlpack``, ``cupy.from_dlpack``, ``cupy.asarray``);
    ``cpu`` buffers expose the buffer protocol (Python 3.12+), ``__array_interface__`` and
    ``__dlpack__`` (``numpy.asarray``, ``memoryview``, ``torch.from_dlpack``). None copies.

    Parameters
    ----------
    client:
        Renews and releases the lease (a :class:`Client`); ``None`` for a buffer this object
        must never release.
    info:
        The lease as the server sent it (``buffer_id``, ``nbytes``, ``handle``...).
    release_on_close:
        Whether :meth:`close` releases the lease by default.
    wait:
        Whether to wait, before returning, for copies still landing in the buffer (its
        handle's ``ready_event``); False leaves that to the caller (:func:`wait_ready`).

    Attributes
    ----------
    id, nbytes, device, dtype, shape, expires_at:
        From the lease; ``info`` is the whole lease as the server sent it.
    read_only:
        The buffer may be shared with other leases: never write it (see the module
        docstring for what refuses writes).
    source:
        Where the bytes came from: ``gpu``, ``peer``, ``memory``, ``page_cache``, ``storage``
        or ``object_store`` (None from a server without it).
    reused:
        The lease hands out a copy that was already resident (nothing was read for it).
    """

    def __init__(
        self,
        client: LeaseHolder | None,
        info: Mapping[str, Any],
        *,
        release_on_close: bool = True,
        wait: bool = True,
    ) -> None:
        self.info = dict(info)
        self.id: str = info["buffer_id"]
        self.nbytes: int = int(info["nbytes"])
        self.device: str = info["device"]
        self.dtype: str = info["dtype"]
        self.shape: tuple[int, ...] = tuple(info["shape"])
        self.expires_at: str = info["expires_at"]
        self.read_only: bool = bool(info.get("read_only") or info["handle"].get("read_only"))
        self.source: str | None = info.get("source")
        self.reused: bool = bool(info.get("reused"))
        self._client = client
        self._release_on_close = release_on_close
        self._attached: Attached | None = attach(info["handle"], self.nbytes)
        if wait:
            wait_ready([info["handle"]])  # copies still landing (a wait=false load)
        flat = self._attached.array
        # Kept even after close(): arrays made through __array_interface__ or
        # __cuda_array_interface__ hold this object, not the array, and must stay mapped.
        self._array: Any = flat.view(np.dtype(self.dtype)).reshape(self.shape)
        self._closed = False

    @property
    def array(self) -> Any:
        """The data as a CuPy (``cuda``) or NumPy (``cpu``) array of ``dtype`` and ``shape``."""
        if self._closed:
            raise TierdClientError(f"buffer {self.id} is closed")
        return self._array

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def view(self, offset: int, nbytes: int, dtype: Any, shape: Sequence[int]) -> Any:
        """An array over ``nbytes`` at byte ``offset`` of the buffer (for packed tensors)."""
        if self._attached is None:
            raise TierdClientError(f"buffer {self.id} is closed")
        flat = self._attached.array[offset : offset + nbytes]
        return flat.view(np.dtype(dtype)).reshape(tuple(shape))

    # -- interchange protocols -----------------------------------------------------------
    def __dlpack__(self, **kwargs: Any) -> Any:
        arr = self.array
        if not self.read_only:
            return arr.__dlpack__(**kwargs)
        if self.is_cuda:
            return _mark_read_only(arr.__dlpack__(**kwargs))
        if tuple(kwargs.get("max_version") or (0, 0)) < (1, 0):
            # NumPy will not export a read-only array to a consumer that cannot be told so
            # (DLPack before 1.0, e.g. older torch): it gets a writable alias instead.
            arr = _writable(arr)
        return arr.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        dev = self.array.__dlpack_device__()
        return int(dev[0]), int(dev[1])

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if not self.is_cuda:
            raise AttributeError("__cuda_array_interface__: this buffer is in host memory")
        cai: dict[str, Any] = self.array.__cuda_array_interface__
        if self.read_only:
            cai = {**cai, "data": (cai["data"][0], True)}
        return cai

    @property
    def __array_interface__(self) -> dict[str, Any]:
        if self.is_cuda:
            raise AttributeError("__array_interface__: this buffer is in GPU memory")
        ai: dict[str, Any] = self.array.__array_interface__
        return ai

    def __buffer__(self, flags: int) -> memoryview:
        if self.is_cuda:
            raise TypeError("a GPU buffer has no buffer protocol; use __dlpack__")
        return memoryview(self.array)

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    # -- lease -----------------------------------------------------------------------------
    def renew(self, ttl_s: float | None = None) -> None:
        """Restart the lease's TTL (``ttl_s``, default the lease's own)."""
        if self._client is None:
            raise TierdClientError("this buffer has no client to renew it with")
        info = self._client.renew(self.id, ttl_s)
        self.expires_at = info["expires_at"]

    def close(self, release: bool | None = None) -> None:
        """Close the buffer and (by default) release the lease. Idempotent.

        The mapping itself closes once neither this object nor any array made from it is
        alive, so a tensor that still views the memory never faults.
        """
        if self._closed:
            return
        self._closed = True
        attached, self._attached = self._attached, None
        if attached is not None:
            attached.close()
        release = self._release_on_close if release is None else release
        if release and self._client is not None:
            with contextlib.suppress(NotFound):  # expired already: nothing to give back
                self._client.release(self.id)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        ro = " read-only" if self.read_only else ""
        return (
            f"<Buffer {self.id} {self.device} {self.dtype}{list(self.shape)} "
            f"{self.nbytes} bytes{ro} {state}>"
        )


# DLManagedTensorVersioned (dlpack.h, DLPack 1.0): version (2 x uint32), manager_ctx, deleter,
# then the uint64 flags.
_DLPACK_FLAGS_AT = 8 + 2 * ctypes.sizeof(ctypes.c_void_p)
_DLPACK_READ_ONLY = 1
_capsule_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


def _mark_read_only(capsule: Any) -> Any:
    """Set DLPack's read-only flag on a versioned capsule (CuPy exports its arrays writable);
    an unversioned capsule has no flags to set."""
    name = b"dltensor_versioned"
    if _capsule_valid(capsule, name):
        ptr = _capsule_pointer(capsule, name)
        if ptr:
            flags = ctypes.c_uint64.from_address(ptr + _DLPACK_FLAGS_AT)
            flags.value |= _DLPACK_READ_ONLY
    return capsule


def _writable(arr: np.ndarray) -> np.ndarray:
    """A writable view of a read-only view of a writable mapping (the same memory)."""
    alias = arr.view()
    alias.flags.writeable = True
    return alias


class Tensors(Closing, Mapping[str, Any]):
    """Tensors of a safetensors load: ``{name: array}`` over the shards' buffers.

    Arrays are CuPy or NumPy views in the storage dtype: BF16 and F8 tensors come as their raw
    bits (``uint16``/``uint8``); ``dtypes`` has every tensor's safetensors dtype, and
    :meth:`torch` gives torch tensors with the exact dtypes, still without a copy.
    """

    #: Of a multi-device load: the device these tensors are on, the rank it holds (None
    #: without sharding), how its bytes came (read, peer or host).
    device: str | None = None
    rank: int | None = None
    delivery: str | None = None

    def __init__(self, buffers: list[Buffer], layout: Mapping[str, Mapping[str, Any]]) -> None:
        self.buffers = buffers
        by_id = {b.id: b for b in buffers}
        self.dtypes: dict[str, str] = {}
        #: Of a sharded load: each tensor's whole shape, and its slice's index in it.
        self.full_shapes: dict[str, tuple[int, ...]] = {}
        self.slice_offsets: dict[str, tuple[int, ...]] = {}
        #: Each tensor's buffer and byte offset in it, its size in bytes and its shape.
        self.locations: dict[str, tuple[Buffer, int]] = {}
        self.nbytes: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        # Arrays are made at first use: a CuPy view costs microseconds, a checkpoint has
        # hundreds of tensors, and a state dict makes its torch tensors without them.
        self._arrays: dict[str, Any] = {}
        for name, t in layout.items():
            buf = by_id[t["buffer_id"]]
            self.dtypes[name] = t["dtype"]
            self.locations[name] = (buf, int(t["offset"]))
            self.nbytes[name] = int(t["nbytes"])
            self.shapes[name] = tuple(t["shape"])
            if t.get("full_shape") is not None:
                self.full_shapes[name] = tuple(t["full_shape"])
                self.slice_offsets[name] = tuple(t["slice_offset"])

    def __getitem__(self, name: str) -> Any:
        arr = self._arrays.get(name)
        if arr is None:
            buf, offset = self.locations[name]
            storage = DTYPES[self.dtypes[name]].storage
            arr = buf.view(offset, self.nbytes[name], storage, self.shapes[name])
            self._arrays[name] = arr
        return arr

    def __iter__(self) -> Iterator[str]:
        return iter(self.locations)

    def __len__(self) -> int:
        return len(self.locations)

    def torch(self) -> dict[str, Any]:
        """``{name: torch.Tensor}`` with torch's exact dtypes (bfloat16, float8...)."""
        import torch
        from torch.utils.dlpack import from_dlpack  # what torch re-exports as torch.from_dlpack

        out = {}
        for name, arr in self.items():
            try:
                t = from_dlpack(arr)
            except BufferError:
                # A read-only NumPy view and a torch before DLPack 1.0, which cannot be told
                # "read-only" (nor has read-only tensors): share the memory writable.
                t = from_dlpack(_writable(arr))
            exact = DTYPES[self.dtypes[name]].exact
            out[name] = t.view(getattr(torch, exact)) if exact else t
        return out

    def wait(self) -> None:
        """Wait until every shard's bytes have landed (only a load opened without waiting
        needs it: see :func:`~tierd_client._loads.open_tensors`)."""
        wait_ready(b.info["handle"] for b in self.buffers)

    def close(self, release: bool | None = None) -> None:
        """Close every shard's buffer (and release the leases, by default)."""
        for table in (self._arrays, self.locations, self.nbytes, self.shapes):
            table.clear()
        for b in self.buffers:
            b.close(release)


_prewarm_lock = threading.Lock()
_prewarmed = False


def prewarm_cuda() -> None:
    """Import the CUDA binding that opens GPU buffers (CuPy: 0.1–0.3 s) on a thread of its
    own, once per process (from ``import tierd_client``), so that a fresh process's first GPU
    load does not pay it: an engine imports its loader, creates its client, builds its model,
    then loads, and the import runs under all of that. Nothing where CuPy is not installed;
    nothing of CUDA itself is started here."""
    global _prewarmed
    with _prewarm_lock:
        if _prewarmed:
            return
        _prewarmed = True
    try:
        if importlib.util.find_spec("cupy") is None:
            return
    except (ImportError, ValueError):  # a finder that refuses it: not installed, in effect
        return

    def load() -> None:
        with contextlib.suppress(Exception):  # the load that needs it reports any failure
            importlib.import_module("cupy")

    threading.Thread(target=load, name="tierd-client-prewarm", daemon=True).start()
