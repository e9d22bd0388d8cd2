"""Memory that one process fills and another opens: dedicated allocations and their handles.

Two kinds, one per device type:

- ``cuda:N``: a dedicated ``cudaMalloc`` allocation (a ``cupy.cuda.Memory``, never a pool
  sub-allocation: a CUDA IPC handle exposes the whole allocation it points into), rounded up
  to :data:`CUDA_GRANULE` (2 MiB). Its handle is the CUDA IPC memory handle (base64), the GPU's
  UUID and the device index.
- ``cpu``: a POSIX shared-memory segment, rounded up to the page size. Its handle is the
  segment's name.

Every handle also carries ``offset`` (where the data starts inside the allocation) and
``alloc_bytes``, and a lease's handle ``read_only`` (true for buffers that several leases may
share: the holder promised never to write them). Handles are plain JSON: raw bytes only,
nothing is ever pickled.

:func:`allocate` is the exporting side; :func:`attach` is the importing side, run in another
process. A process cannot open its own CUDA IPC handle, so :func:`attach` of a ``cuda`` handle
must run in a second process.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import mmap
import os
import secrets
import threading
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from tiering.errors import FileNotFound, InsufficientSpace, InvalidInput

from ._device import Device, gpu_uuid, import_cupy, local_device
from .shm import SHM_DIR as _SHM_DIR
from .shm import SHM_PREFIX, idle_prefix, segment_name

if TYPE_CHECKING:
    from .fences import Fence

__all__ = [
    "CUDA_GRANULE",
    "Attached",
    "DeviceBuffer",
    "alloc_size",
    "allocate",
    "attach",
    "gpu_uuid",
]

CUDA_GRANULE = 2 << 20
"""Allocation granularity on a GPU: what cudaMalloc hands out for large requests anyway."""

_PAGE = mmap.PAGESIZE


def alloc_size(device: Device, nbytes: int) -> int:
    """Bytes allocated for ``nbytes`` of data on ``device`` (never 0)."""
    granule = CUDA_GRANULE if device.is_cuda else _PAGE
    return max(granule, -(-nbytes // granule) * granule)


class DeviceBuffer(ABC):
    """One dedicated allocation that can be handed to another process."""

    device: Device
    alloc_bytes: int
    #: Copies into the buffer queued by a load that replied before they landed (see
    #: :mod:`tiering.io.fences`); None once they have, or when there were none.
    fence: Fence | None = None

    def settle(self) -> None:
        """Wait for the copies of the buffer's pending fence, if any; then it has none."""
        fence, self.fence = self.fence, None
        if fence is not None:
            fence.wait()

    @abstractmethod
    def array(self) -> Any:
        """The whole allocation as a flat ``uint8`` array (CuPy or NumPy)."""

    @abstractmethod
    def handle(self) -> dict[str, Any]:
        """What another process needs to open it (JSON-able, ``offset`` 0)."""

    @abstractmethod
    def free(self) -> None:
        """Give the memory back. Idempotent."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until every write into the buffer has landed (a GPU's copies are async)."""

    def park(self) -> bool:
        """Get ready to wait in a :class:`~tiering.io.bufferpool.BufferPool`; False when it
        cannot (then free it)."""
        return True

    def unpark(self) -> bool:
        """Get ready for its next lease; False when it cannot (then free it)."""
        return True


class _CudaBuffer(DeviceBuffer):
    def __init__(self, device: Device, nbytes: int) -> None:
        cp = import_cupy()
        self.device = device
        self.alloc_bytes = alloc_size(device, nbytes)
        with cp.cuda.Device(device.index):
            # cupy.cuda.Memory is a plain cudaMalloc, not a pool block: the handle must not
            # expose anybody else's bytes.
            self._mem: Any = cp.cuda.Memory(self.alloc_bytes)
            ipc = cp.cuda.runtime.ipcGetMemHandle(self._mem.ptr)
        self._ipc = base64.b64encode(bytes(ipc)).decode("ascii")
        self._uuid = gpu_uuid(device.index)

    def array(self) -> Any:
        cp = import_cupy()
        if self._mem is None:
            raise InvalidInput("buffer was freed")
        ptr = cp.cuda.MemoryPointer(self._mem, 0)
        return cp.ndarray((self.alloc_bytes,), dtype=cp.uint8, memptr=ptr)

    def handle(self) -> dict[str, Any]:
        h = {
            "kind": "cuda_ipc",
            "ipc_handle": self._ipc,
            "offset": 0,
            "alloc_bytes": self.alloc_bytes,
            "device_index": self.device.index,
            "gpu_uuid": self._uuid,
        }
        ready = None if self.fence is None else self.fence.handle()
        if ready is not None:
            h["ready_event"] = ready  # the bytes land when it fires: wait_ready
        return h

    def synchronize(self) -> None:
        import_cupy().cuda.Device(self.device.index).synchronize()

    def free(self) -> None:
        # cudaFree runs when the last reference to the Memory goes; the service keeps none.
        self._mem = None

    def park(self) -> bool:
        return self._mem is not None

    def unpark(self) -> bool:
        self.settle()  # the last load's copies must not land in the next one's bytes
        return True


class _ShmBuffer(DeviceBuffer):
    def __init__(self, device: Device, nbytes: int) -> None:
        self.device = device
        self.alloc_bytes = alloc_size(device, nbytes)
        self.name = segment_name()
        # /dev/shm directly rather than multiprocessing.shared_memory: its resource tracker
        # would unlink segments at exit (or warn about them) behind the lease table's back.
        path = _SHM_DIR / self.name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                # Reserve the pages now: a full tmpfs then fails here with ENOSPC instead of
                # killing the process with SIGBUS in the middle of a read.
                os.posix_fallocate(fd, 0, self.alloc_bytes)
            except OSError as exc:
                raise InsufficientSpace(
                    f"{_SHM_DIR} has no room for {self.alloc_bytes} bytes: {exc.strerror}",
                    device="cpu",
                    requested=self.alloc_bytes,
                ) from exc
            # Not MAP_POPULATE: mapping every page up front, in one thread, took longer than
            # the readers' own faults (a 1 GiB remote load into cpu fell from 3.2 to 1.7 GB/s).
            self._map: mmap.mmap | None = mmap.mmap(fd, self.alloc_bytes)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    def array(self) -> Any:
        if self._map is None:
            raise InvalidInput("buffer was freed")
        return np.frombuffer(self._map, dtype=np.uint8, count=self.alloc_bytes)

    def synchronize(self) -> None:
        return None  # the host's own writes: visible once the read returned

    def handle(self) -> dict[str, Any]:
        return {"kind": "shm", "name": self.name, "offset": 0, "alloc_bytes": self.alloc_bytes}

    def park(self) -> bool:
        # The released lease's name must stop opening; the pages stay, so the next lease of
        # this size takes no page faults (a fresh tmpfs page is allocated and zeroed on its
        # first touch: a 256 MiB remote load into cpu ran at 0.43 GB/s into new segments and
        # 1.0 into kept ones on the 2-core machine).
        return self._map is not None and self._rename(f"{idle_prefix()}{secrets.token_hex(8)}")

    def unpark(self) -> bool:
        return self._rename(segment_name())

    def _rename(self, name: str) -> bool:
        try:
            os.rename(_SHM_DIR / self.name, _SHM_DIR / name)
        except OSError:
            return False
        self.name = name
        return True

    def free(self) -> None:
        mapping, self._map = self._map, None
        if mapping is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_SHM_DIR / self.name)  # the name goes; clients keep their mappings
        with contextlib.suppress(BufferError):
            mapping.close()  # a view still alive: it unmaps when that view is collected


def allocate(device: Device, nbytes: int) -> DeviceBuffer:
    """A dedicated, shareable allocation of at least ``nbytes`` on ``device``.

    Raises
    ------
    BackendUnavailable
        A CUDA device and no CuPy.
    """
    if nbytes < 0:
        raise InvalidInput(f"nbytes must not be negative, got {nbytes}")
    return _CudaBuffer(device, nbytes) if device.is_cuda else _ShmBuffer(device, nbytes)


# -- the importing side -----------------------------------------------------------------------


def _close_cuda(ptr: int, device_index: int) -> None:
    with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
        cp = import_cupy()
        with cp.cuda.Device(device_index):
            cp.cuda.runtime.ipcCloseMemHandle(ptr)


# Mappings of small allocations stay open after their last user for the next buffer with the
# same handle: the service reuses its allocations (BufferPool), and cudaIpcOpenMemHandle plus
# cudaIpcCloseMemHandle cost more than a small load. A handle names one live allocation, so
# a cached mapping is only ever used for the allocation it maps.
_MAP_CACHE_MAX_BYTES = 64 << 20
_MAP_CACHE_ENTRIES = 32
_map_lock = threading.Lock()
_map_users: dict[str, tuple[int, int, int]] = {}  # handle -> (ptr, device, users)
_map_idle: OrderedDict[str, tuple[int, int]] = OrderedDict()  # handle -> (ptr, device)


def _open_cuda(key: str, raw: bytes, index: int, alloc: int) -> int:
    with _map_lock:
        found = _map_users.get(key)
        if found is not None:
            _map_users[key] = (found[0], found[1], found[2] + 1)
            return found[0]
        idle = _map_idle.pop(key, None)
        if idle is not None:
            _map_users[key] = (idle[0], idle[1], 1)
            return idle[0]
    cp = import_cupy()
    with cp.cuda.Device(index):
        ptr = int(cp.cuda.runtime.ipcOpenMemHandle(raw, 1))  # cudaIpcMemLazyEnablePeerAccess
    with _map_lock:
        _map_users[key] = (ptr, index, 1)
    return ptr


def _unuse_cuda(key: str, alloc: int) -> None:
    close: list[tuple[int, int]] = []
    with _map_lock:
        ptr, index, users = _map_users.pop(key)
        if users > 1:
            _map_users[key] = (ptr, index, users - 1)
        elif alloc <= _MAP_CACHE_MAX_BYTES:
            _map_idle[key] = (ptr, index)
            while len(_map_idle) > _MAP_CACHE_ENTRIES:
                close.append(_map_idle.popitem(last=False)[1])
        else:
            close.append((ptr, index))
    for p, i in close:
        _close_cuda(p, i)


def close_cached_mappings() -> None:
    """Close the idle CUDA IPC mappings this process keeps for reuse."""
    with _map_lock:
        idle = list(_map_idle.values())
        _map_idle.clear()
    for p, i in idle:
        _close_cuda(p, i)


class Attached:
    """A handle opened in this process: a flat ``uint8`` array over the shared bytes.

    ``array`` covers ``[offset, offset + nbytes)`` of the allocation. :meth:`close` drops this
    object's reference; the mapping itself (``cudaIpcCloseMemHandle`` or ``munmap``) goes
    when no array made from it is alive any more, so a tensor that still views the memory
    never faults.

    ``read_only`` handles give a non-writable NumPy array (views of it are too); a CuPy
    array has no such flag, so there it is the caller's promise alone.
    """

    def __init__(
        self, array: Any, device: Device, mapping: Callable[[], Any], read_only: bool = False
    ) -> None:
        self._array: Any = array
        self.device = device
        self._mapping = mapping
        self.read_only = read_only

    @property
    def array(self) -> Any:
        if self._array is None:
            raise InvalidInput("this buffer is closed")
        return self._array

    @property
    def closed(self) -> bool:
        return self._array is None

    @property
    def mapped(self) -> bool:
        """Whether the mapping is still open (some array still views it)."""
        return self._mapping() is not None

    def close(self) -> None:
        self._array = None


class _MappingOwner:
    """Owner object of an imported mapping; its finalizer closes the mapping."""

    __slots__ = ("__weakref__",)


def attach(handle: Mapping[str, Any], nbytes: int | None = None) -> Attached:
    """Open a handle from :meth:`DeviceBuffer.handle` (with its ``offset``) in this process.

    Parameters
    ----------
    handle:
        The JSON handle.
    nbytes:
        Bytes to expose from ``offset``; default: to the end of the allocation.

    Raises
    ------
    InvalidInput
        A malformed handle.
    InvalidDevice
        The GPU is not visible to this process.
    FileNotFound
        The shared-memory segment is gone (the lease was released or expired).
    """
    try:
        kind = handle["kind"]
        offset = int(handle.get("offset", 0))
        alloc = int(handle["alloc_bytes"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidInput(f"not a tierd buffer handle: {exc}") from exc
    size = alloc - offset if nbytes is None else int(nbytes)
    if offset < 0 or size < 0 or offset + size > alloc:
        raise InvalidInput(f"[{offset}, {offset + size}) is outside the {alloc} byte allocation")
    read_only = handle.get("read_only") is True
    if kind == "cuda_ipc":
        out = _attach_cuda(handle, offset, size, alloc)
    elif kind == "shm":
        out = _attach_shm(str(handle["name"]), offset, size, alloc)
    else:
        raise InvalidInput(f"unknown handle kind {kind!r}")
    if read_only:
        out.read_only = True
        if isinstance(out.array, np.ndarray):
            # The segment stays mapped read-write (a DLPack consumer older than DLPack 1.0
            # cannot be told "read-only", and gets a writable alias; see tierd_client), but
            # every NumPy view of it refuses writes.
            out.array.flags.writeable = False
    return out


def _attach_cuda(handle: Mapping[str, Any], offset: int, size: int, alloc: int) -> Attached:
    cp = import_cupy()
    try:
        raw = base64.b64decode(handle["ipc_handle"], validate=True)
    except (KeyError, binascii.Error) as exc:
        raise InvalidInput(f"bad CUDA IPC handle: {exc}") from exc
    index = local_device(int(handle.get("device_index", 0)), handle.get("gpu_uuid"))
    key = str(handle["ipc_handle"])
    ptr = _open_cuda(key, raw, index, alloc)
    owner = _MappingOwner()
    finalizer = weakref.finalize(owner, _unuse_cuda, key, alloc)
    # The memory object keeps ``owner`` alive, and every array made from it keeps the memory:
    # the IPC mapping closes when the last of them is collected.
    mem = cp.cuda.UnownedMemory(ptr, alloc, owner, device_id=index)
    arr = cp.ndarray((size,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, offset))
    return Attached(arr, Device("cuda", index), lambda: finalizer.alive or None)


def _attach_shm(name: str, offset: int, size: int, alloc: int) -> Attached:
    if not name.startswith(SHM_PREFIX) or "/" in name or name in (".", ".."):
        raise InvalidInput(f"not a tierd shared-memory segment: {name!r}")
    try:
        fd = os.open(_SHM_DIR / name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError as exc:
        raise FileNotFound(
            f"shared-memory segment {name} is gone: the lease was released or expired",
            name=name,
        ) from exc
    try:
        have = os.fstat(fd).st_size
        if have < alloc:
            raise InvalidInput(f"segment {name} has {have} bytes, the handle says {alloc}")
        mapping = mmap.mmap(fd, alloc)
    finally:
        os.close(fd)
    # Every view keeps the mmap alive; it unmaps when the last one is collected.
    arr = np.frombuffer(mapping, dtype=np.uint8, count=size, offset=offset)
    alive = weakref.ref(mapping)
    del mapping
    return Attached(arr, Device("cpu"), alive)
