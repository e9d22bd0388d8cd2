"""Checks of what callers pass a storage: dtypes, byte ranges, target buffers, alignment.

Each raises the :mod:`tiering.errors` error that names what is wrong, before any I/O starts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tiering.errors import (
    InvalidDevice,
    InvalidDtype,
    InvalidInput,
    InvalidRange,
    MisalignedBuffer,
)

from ._config import GdsConfig
from ._device import Device, import_cupy
from ._file import GdsFile

__all__ = ["check_alignment", "check_range", "flat_target", "parse_dtype"]


def parse_dtype(dtype: Any) -> np.dtype[Any]:
    """``dtype`` as a NumPy dtype whose items can be read from raw bytes."""
    try:
        dt: np.dtype[Any] = np.dtype(dtype)
    # NumPy parses comma strings ("i4,f8") with ast: "," is a SyntaxError, not a TypeError.
    except (TypeError, ValueError, SyntaxError) as exc:
        raise InvalidDtype(f"not a dtype: {dtype!r}", dtype=str(dtype)) from exc
    if dt.hasobject or dt.itemsize == 0 or dt.kind in "OSUMm":
        raise InvalidDtype(f"dtype {dt} cannot be read from raw bytes", dtype=str(dt))
    return dt


def check_range(file: GdsFile, offset: int, length: int | None) -> int:
    """The byte count of ``[offset, offset + length)`` (``None``: to the end) in ``file``."""
    size = file.size()
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise InvalidRange(f"offset must be an integer, got {offset!r}")
    if length is not None and (
        isinstance(length, bool) or not isinstance(length, (int, np.integer))
    ):
        raise InvalidRange(f"length must be an integer, got {length!r}")
    offset = int(offset)
    if offset < 0 or offset > size:
        raise InvalidRange(
            f"offset {offset} is outside the {size} byte file", offset=offset, size=size
        )
    n = size - offset if length is None else int(length)
    if n < 0 or offset + n > size:
        raise InvalidRange(
            f"range [{offset}, {offset + n}) is outside the {size} byte file",
            offset=offset,
            length=n,
            size=size,
        )
    return n


def flat_target(device: Device, buffer: Any) -> Any:
    """A flat uint8 view of a caller's buffer on ``device``."""
    on_gpu = hasattr(buffer, "__cuda_array_interface__")
    flat = _flat_fast(device, buffer, on_gpu)
    if flat is not None:
        return flat
    if device.is_cuda:
        if not on_gpu:
            raise InvalidDevice(f"buffer is in host memory but this storage loads into {device}")
        cp = import_cupy()
        # Where the memory is, asked of the driver: cupy.asarray alone would copy a buffer
        # of another device onto the calling thread's current one rather than say so.
        ptr = int(buffer.__cuda_array_interface__["data"][0])
        on = cp.cuda.runtime.pointerGetAttributes(ptr).device if ptr else device.index
        if on != device.index:
            raise InvalidDevice(f"buffer is on cuda:{on} but this storage loads into {device}")
        with cp.cuda.Device(device.index):
            arr = cp.asarray(buffer)  # no copy: wraps __cuda_array_interface__
    else:
        if on_gpu:
            raise InvalidDevice("buffer is in GPU memory but this storage loads into cpu")
        try:
            arr = np.asarray(memoryview(buffer)) if not isinstance(buffer, np.ndarray) else buffer
        except TypeError as exc:
            raise InvalidInput(f"not a buffer: {type(buffer).__name__}") from exc
        if not arr.flags.writeable:
            raise InvalidInput("buffer is read-only")
    if not arr.flags.c_contiguous:
        raise MisalignedBuffer("buffer must be C-contiguous")
    return arr.reshape(-1).view(np.uint8) if arr.ndim else arr.reshape(1).view(np.uint8)


def _flat_fast(device: Device, buffer: Any, on_gpu: bool) -> Any:
    """The common case, a flat uint8 array on the right device, without new views."""
    if getattr(buffer, "ndim", 0) != 1 or getattr(buffer, "dtype", None) != np.uint8:
        return None
    if device.is_cuda:
        if on_gpu and type(buffer).__module__.startswith("cupy"):
            data = buffer.data
            if data.device_id == device.index and buffer.flags.c_contiguous:
                return buffer
        return None
    if isinstance(buffer, np.ndarray) and buffer.flags.c_contiguous and buffer.flags.writeable:
        return buffer
    return None


def check_alignment(config: GdsConfig, device: Device, offset: int, nbytes: int, flat: Any) -> None:
    """With ``config.require_alignment``: offset, length and address are all aligned."""
    if not config.require_alignment:
        return
    a = config.alignment
    ptr = int(flat.data.ptr) if device.is_cuda else int(flat.ctypes.data)
    for what, value in (("offset", offset), ("length", nbytes), ("buffer address", ptr)):
        if value % a:
            raise MisalignedBuffer(
                f"{what} {value:#x} is not a multiple of the {a} byte alignment",
                alignment=a,
            )
