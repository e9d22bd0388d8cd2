"""The devices of a load target on this host: ``cuda:*`` counted, and each device checked.

A :class:`~tiering.io.target.LoadTarget` is parsed where the request enters, by spelling
alone; whether its GPUs exist is a question for the host that loads, asked here, once per load.
"""

from __future__ import annotations

from tiering.errors import InvalidDevice
from tiering.io import Device, import_cupy
from tiering.io.target import ALL_GPUS, LoadTarget
from tiering.serving.context import LoadContext

__all__ = ["resolve"]


def _gpu_count() -> int:
    try:
        return int(import_cupy().cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy or no driver: this host has no GPU
        return 0


def resolve(ctx: LoadContext, target: LoadTarget) -> list[Device]:
    """The target's devices on this host, in order (every GPU for ``cuda:*``).

    Raises
    ------
    InvalidDevice
        A device this host does not have; ``cuda:*`` on a host with no GPU.
    """
    if target.every_gpu:
        n = _gpu_count()
        if n == 0:
            raise InvalidDevice(
                f"{ALL_GPUS} names no device: this host has no GPU", device=ALL_GPUS
            )
        return [ctx.device(f"cuda:{i}") for i in range(n)]
    return [ctx.device(str(d)) for d in target.devices]
