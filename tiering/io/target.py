"""Where a load goes: one device, several GPUs that each get every byte (replicas), or a
tensor-parallel sharding with a rank. Parsed once, where a request enters, and passed down.

Three doors take a load's destination: the REST schemas (``device``, ``devices``, ``sharding``,
``rank`` of a body), the Python client's keyword arguments, and the in-process
:class:`~tiering.serving.Loader`. Each builds a :class:`LoadTarget` with :meth:`LoadTarget.parse`
(the client also writes it back as JSON with :meth:`LoadTarget.to_json`), and everything below
takes that value as it is: the loader resolves ``cuda:*`` against the host's GPUs and checks
that each device exists there (:func:`tiering.serving.devices.resolve`), and the sharded load
asks the target for each device's rank (:meth:`LoadTarget.ranks`). Nobody splits the four
fields again.

What is checked here, by the spelling alone (the client has no GPU to ask):

- ``devices``: a list of distinct devices, or ``"cuda:*"`` (alone, as a string or a list of
  one) for every GPU of the host; a string names one device. ``cpu`` is one device however it
  is named, so it is refused beside others rather than guessed at.
- ``sharding`` (see :mod:`tiering.io.sharding`) and ``rank``: a rank needs a spec, and is one
  of its ranks. A load of every rank names one device per rank; one rank, one device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tiering.errors import InvalidDevice, InvalidInput, InvalidSharding

from ._device import Device
from .sharding import ShardingSpec, check_rank, parse_sharding

__all__ = ["ALL_GPUS", "MAX_DEVICES", "LoadTarget"]

ALL_GPUS = "cuda:*"
#: Far above any host's GPU count; bounds what a request can name.
MAX_DEVICES = 64


@dataclass(frozen=True)
class LoadTarget:
    """A load's destination; make one with :meth:`parse` (or :meth:`of` for one device).

    Attributes
    ----------
    devices:
        The devices, in order; empty for every GPU of the host (``cuda:*``).
    many:
        The reply is one entry per device (``devices`` or ``sharding`` was given), even for a
        single device; otherwise it is the single-device reply.
    sharding, rank:
        A tensor-parallel spec, and the one rank to load (None: every rank, one device each).
    """

    devices: tuple[Device, ...]
    many: bool = False
    sharding: ShardingSpec | None = None
    rank: int | None = None

    @classmethod
    def parse(
        cls,
        device: str | Device | None = None,
        devices: str | Sequence[str | Device] | None = None,
        sharding: ShardingSpec | Mapping[str, Any] | None = None,
        rank: int | None = None,
    ) -> LoadTarget:
        """The target a request names: ``device`` (default ``cpu``) or ``devices``, and
        optionally ``sharding`` and ``rank``.

        Raises
        ------
        InvalidDevice
            A name that is no device; an empty or too long list; a device named twice;
            ``cpu`` or ``cuda:*`` beside other devices.
        InvalidSharding
            A bad spec, a rank without one or out of its range, or a device count that does
            not fit (one per rank; one for ``rank``).
        InvalidInput
            Both ``device`` and ``devices``.
        """
        if device is not None and devices is not None:
            raise InvalidInput("give device or devices, not both")
        spec = None if sharding is None else parse_sharding(sharding)
        if rank is not None:
            if spec is None:
                raise InvalidSharding("rank needs a sharding spec")
            check_rank(spec, rank)
        if devices is None:
            devs: tuple[Device, ...] = (Device.parse(device or "cpu"),)
        else:
            devs = _devices(devices)
        target = cls(devs, devices is not None or spec is not None, spec, rank)
        if devs:  # cuda:* is counted where the GPUs are (see ranks)
            target.ranks(len(devs))
        return target

    @classmethod
    def of(cls, where: str | Device | LoadTarget) -> LoadTarget:
        """``where`` itself, or the target of the one device it names."""
        return where if isinstance(where, LoadTarget) else cls.parse(device=where)

    @property
    def every_gpu(self) -> bool:
        """Whether this names every GPU of the host (``cuda:*``): counted where it loads."""
        return not self.devices

    def ranks(self, count: int) -> list[int | None]:
        """The rank each of ``count`` devices loads (None: everything, no sharding).

        Raises
        ------
        InvalidSharding
            A load of every rank without one device per rank; one rank into several devices.
        """
        spec = self.sharding
        if spec is None:
            return [None] * count
        if self.rank is None:
            if count != spec.world_size:
                raise InvalidSharding(
                    f"a load of every rank needs one device per rank: world_size "
                    f"{spec.world_size}, {count} device(s); or ask for one rank with rank=k",
                    world_size=spec.world_size,
                    devices=count,
                )
            return list(range(count))
        if count != 1:
            raise InvalidSharding(
                f"rank={self.rank} loads one rank into one device; {count} devices were named"
            )
        return [self.rank]

    def alone(self, what: str) -> Device:
        """The device of a single-device target (not ``many``).

        Raises
        ------
        InvalidInput
            A ``many`` target; ``what`` names the option that needs one device.
        """
        if not self.many:
            return self.devices[0]
        raise InvalidInput(f"{what} take one device and no sharding")

    def to_json(self) -> dict[str, Any]:
        """The request fields that name this target (for a body of the REST API)."""
        out: dict[str, Any] = {}
        if not self.many:
            out["device"] = str(self.devices[0])
        else:
            out["devices"] = [str(d) for d in self.devices] if self.devices else [ALL_GPUS]
        if self.sharding is not None:
            out["sharding"] = self.sharding.to_json()
        if self.rank is not None:
            out["rank"] = self.rank
        return out


def _devices(devices: str | Sequence[str | Device]) -> tuple[Device, ...]:
    """A ``devices`` value, checked; ``()`` for every GPU."""
    items: Sequence[str | Device] = [devices] if isinstance(devices, str) else devices
    if isinstance(items, Mapping) or not isinstance(items, Sequence):
        raise InvalidDevice(f"devices must be a list of devices or {ALL_GPUS!r}, got {devices!r}")
    if not items:
        raise InvalidDevice("devices must name at least one device")
    if len(items) > MAX_DEVICES:
        raise InvalidDevice(f"{len(items)} devices is over the limit of {MAX_DEVICES}")
    if any(isinstance(d, str) and d.strip().lower() == ALL_GPUS for d in items):
        if len(items) > 1:
            raise InvalidDevice(f"{ALL_GPUS} names every GPU: give it alone", device=ALL_GPUS)
        return ()
    out = tuple(Device.parse(d) for d in items)
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
