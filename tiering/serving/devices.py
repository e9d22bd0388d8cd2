"""Device lists of multi-device loads: ``["cuda:0", "cuda:1"]``, or ``"cuda:*"`` for every GPU.

A list of one device is the single-device load. A longer list names distinct GPUs: host
memory is one device however it is named, so ``["cpu", "cpu"]`` or ``cpu`` beside a GPU asks
for nothing a single ``cpu`` load does not give, and is refused rather than guessed at.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiering.errors import InvalidDevice
from tiering.io import Device
from tiering.io._device import import_cupy
from tiering.serving.context import LoadContext

__all__ = ["ALL_GPUS", "MAX_DEVICES", "parse_devices"]

ALL_GPUS = "cuda:*"
#: Far above any host's GPU count; bounds what a request can name.
MAX_DEVICES = 64


def _gpu_count() -> int:
    try:
        return int(import_cupy().cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy or no driver: this host has no GPU
        return 0


def parse_devices(ctx: LoadContext, devices: str | Sequence[str | Device]) -> list[Device]:
    """Check a device list (or ``"cuda:*"``) and return its devices, in order.

    Raises
    ------
    InvalidDevice
        An empty list, an unknown device, a device named twice, ``cpu`` in a list of more
        than one, or ``cuda:*`` on a host with no GPU.
    """
    if isinstance(devices, str):
        devices = [devices]
    if not devices:
        raise InvalidDevice("devices must name at least one device")
    if len(devices) > MAX_DEVICES:
        raise InvalidDevice(f"{len(devices)} devices is over the limit of {MAX_DEVICES}")
    out: list[Device] = []
    for spec in devices:
        if spec == ALL_GPUS:
            n = _gpu_count()
            if n == 0:
                raise InvalidDevice("cuda:* names no device: this host has no GPU", device=spec)
            out.extend(ctx.device(f"cuda:{i}") for i in range(n))
        else:
            out.append(ctx.device(spec))
    if len(out) > 1:
        if any(not d.is_cuda for d in out):
            raise InvalidDevice(
                "cpu cannot be one of several devices: host memory is one device; "
                "load to cpu alone, or list GPUs only",
                devices=", ".join(map(str, out)),
            )
        seen: set[Device] = set()
        for d in out:
            if d in seen:
                raise InvalidDevice(f"{d} is named twice in devices", device=str(d))
            seen.add(d)
    return out
