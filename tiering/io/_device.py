"""Devices (``cpu``, ``cuda:N``) and the lazy imports of the CUDA stack."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from tiering.errors import BackendUnavailable, InvalidDevice

__all__ = ["Device", "import_cupy", "parse_device"]

_DEVICE_RE = re.compile(r"^(?:(cpu)|cuda(?::(\d+))?)$")

CUPY_HINT = "install the GPU extra: pip install 'tierd[gpu]' (cupy-cuda13x, kvikio-cu13)"


def import_cupy() -> ModuleType:
    """Import CuPy, or raise :class:`BackendUnavailable` with an install hint."""
    try:
        return importlib.import_module("cupy")
    except ImportError as exc:
        raise BackendUnavailable(f"CuPy is not installed; {CUPY_HINT}") from exc


@dataclass(frozen=True)
class Device:
    """Where loaded bytes end up: host memory (``cpu``) or one CUDA device."""

    kind: str  # "cpu" or "cuda"
    index: int = 0

    @classmethod
    def parse(cls, device: str | int | Device) -> Device:
        """The device a name means, by its spelling alone (whether it exists here is
        :func:`parse_device`'s question): ``"cpu"``, ``"cuda"`` (device 0), ``"cuda:N"``, a
        bare index ``N`` or a :class:`Device`.

        Raises
        ------
        InvalidDevice
            The name is no device's.
        """
        if isinstance(device, Device):
            return device
        if isinstance(device, bool):  # bool is an int; True is no device
            raise InvalidDevice(f"not a device: {device!r}")
        if isinstance(device, int):
            if device < 0:
                raise InvalidDevice(f"device index must be >= 0, got {device}")
            return cls("cuda", device)
        if isinstance(device, str):
            m = _DEVICE_RE.match(device.strip().lower())
            if not m:
                raise InvalidDevice(
                    f"not a device: {device!r}; use 'cpu' or 'cuda:N'", device=device
                )
            return cls("cpu") if m.group(1) else cls("cuda", int(m.group(2) or 0))
        raise InvalidDevice(f"not a device: {device!r}")

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def xp(self) -> ModuleType:
        """The array module for this device: NumPy or CuPy."""
        return import_cupy() if self.is_cuda else np

    def empty(self, nbytes: int) -> Any:
        """A fresh flat ``uint8`` array of ``nbytes`` on this device."""
        if not self.is_cuda:
            return np.empty(nbytes, dtype=np.uint8)
        cp = import_cupy()
        with cp.cuda.Device(self.index):
            return cp.empty(nbytes, dtype=cp.uint8)

    def make_current(self) -> None:
        """Make this device current on the calling thread (once per thread).

        KvikIO's synchronous reads use the driver API's current context; since CUDA 12,
        ``cudaSetDevice`` creates and binds the primary context, which is what they need.
        """
        if not self.is_cuda:
            return
        runtime = import_cupy().cuda.runtime
        done: set[int] = _tls.__dict__.setdefault("devices", set())
        # A thread that made another device current since must switch back: remembering
        # only "done once" left reads of two GPUs from one thread on whichever came last.
        if self.index not in done or runtime.getDevice() != self.index:
            runtime.setDevice(self.index)
            done.add(self.index)

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """This device current on the calling thread for the block, and the thread's device
        before it current again after: a load into ``cuda:1`` from a caller's thread must not
        move the caller's own work (its CuPy or torch calls) to ``cuda:1``."""
        if not self.is_cuda:
            yield
            return
        runtime = import_cupy().cuda.runtime
        before = runtime.getDevice()
        self.make_current()
        try:
            yield
        finally:
            if before != self.index:
                runtime.setDevice(before)


_tls = threading.local()


def parse_device(device: str | int | Device) -> Device:
    """Parse and check a device.

    Parameters
    ----------
    device:
        ``"cpu"``, ``"cuda"`` (device 0), ``"cuda:N"``, a bare index ``N`` or a :class:`Device`.

    Raises
    ------
    InvalidDevice
        The string names no device, or no such CUDA device exists here.
    BackendUnavailable
        A CUDA device was asked for and CuPy is not installed.
    """
    parsed = Device.parse(device)
    if parsed.is_cuda:
        cp = import_cupy()
        try:
            count = int(cp.cuda.runtime.getDeviceCount())
        except Exception as exc:  # CUDARuntimeError: no driver, no device
            raise InvalidDevice(
                f"{parsed} does not exist: CUDA reports no usable device ({exc})",
                device=str(parsed),
            ) from exc
        if parsed.index >= count:
            raise InvalidDevice(
                f"{parsed} does not exist: this host has {count} CUDA device(s)",
                device=str(parsed),
                device_count=count,
            )
    return parsed


_uuids: dict[int, str] = {}


def gpu_uuid(index: int) -> str:
    """The UUID of CUDA device ``index``, as ``nvidia-smi -L`` prints it (``GPU-…``)."""
    found = _uuids.get(index)
    if found is None:
        h = _driver_uuid(index)
        if h is None:
            raw = import_cupy().cuda.runtime.getDeviceProperties(index)["uuid"]
            h = bytes(raw).hex() if not isinstance(raw, str) else raw.encode("latin-1").hex()
        found = _uuids[index] = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
    return found


def _driver_uuid(index: int) -> str | None:
    """The device's UUID (hex) from the driver's ``cuDeviceGetUuid_v2``, or None where the
    driver does not answer. cudaGetDeviceProperties fills every property to give the same 16
    bytes: 1 ms of a fresh client's first GPU load on the H200 host, where this is below a
    microsecond. Called once the runtime has started the driver (a handle is being opened)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        get = getattr(driver, "cuDeviceGetUuid_v2", None) or driver.cuDeviceGetUuid
        dev, uuid = ctypes.c_int(), (ctypes.c_ubyte * 16)()
        if driver.cuDeviceGet(ctypes.byref(dev), index) or get(ctypes.byref(uuid), dev):
            return None
    except (OSError, AttributeError):
        return None
    return bytes(uuid).hex()


def local_device(index: int, uuid: str | None) -> int:
    """This process's index of the GPU the handle is on (CUDA_VISIBLE_DEVICES may differ)."""
    cp = import_cupy()
    count = int(cp.cuda.runtime.getDeviceCount())
    if uuid:
        for i in range(count):
            if gpu_uuid(i) == uuid:
                return i
        raise InvalidDevice(f"GPU {uuid} is not visible to this process", device=uuid)
    if index >= count:
        raise InvalidDevice(f"cuda:{index} does not exist in this process", device=index)
    return index
