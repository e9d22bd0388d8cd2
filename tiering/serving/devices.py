"""The devices of a load target on this host: ``cuda:*`` counted, and each device checked.

A :class:`~tiering.io.target.LoadTarget` is parsed where the request enters, by spelling
alone; whether its GPUs exist is a question for the host that loads, asked here, once per load.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiering.errors import InvalidDevice
from tiering.io import Device, import_cupy
from tiering.io.sharding import ShardingSpec
from tiering.io.target import ALL_GPUS, LoadTarget
from tiering.serving.context import LoadContext

__all__ = ["Placed", "place", "resolve"]


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


@dataclass(frozen=True)
class Placed:
    """A :class:`~tiering.io.target.LoadTarget` on this host, resolved once where a load enters
    (the :class:`~tiering.serving.Loader`), then passed down as it is: the devices in order,
    the rank each loads (None: no sharding) and the sharding. The steps below it ask it, never
    the host or the target again."""

    target: LoadTarget
    devices: tuple[Device, ...]
    ranks: tuple[int | None, ...]

    @property
    def sharding(self) -> ShardingSpec | None:
        return self.target.sharding

    def alone(self, what: str) -> Device:
        """The one device of a single-device target; :meth:`LoadTarget.alone` says when not."""
        self.target.alone(what)
        return self.devices[0]


def place(ctx: LoadContext, target: LoadTarget) -> Placed:
    """``target`` on this host: its devices (:func:`resolve`) and the rank each loads.

    Raises
    ------
    InvalidDevice
        A device this host does not have.
    InvalidSharding
        A load of every rank without one device per rank; one rank into several devices.
    """
    devices = resolve(ctx, target)
    return Placed(target, tuple(devices), tuple(target.ranks(len(devices))))
