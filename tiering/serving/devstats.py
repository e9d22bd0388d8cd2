"""Loads per device: bytes, operations, seconds and GB/s of every load into each device.

The data path's :class:`~tiering.io.Stats` counts by I/O path, tier and source; a host with
several GPUs also needs to see each GPU's share (is one link saturated while another idles?).
Fed from the loader's observer, so it counts exactly what the observer is told: one report
per lease or shard, replicas and peer copies included (``io_path`` ``copy``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from tiering.io import Device, IoReport

__all__ = ["DeviceStats"]


@dataclass
class _Counts:
    nbytes: int = 0
    ops: int = 0
    seconds: float = 0.0


class DeviceStats:
    """Thread-safe counters per device; ``snapshot()`` for ``GET /v1/stats``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: dict[str, _Counts] = {}

    def record(self, device: Device, report: IoReport) -> None:
        with self._lock:
            c = self._by.setdefault(str(device), _Counts())
            c.nbytes += report.nbytes
            c.ops += 1
            c.seconds += report.seconds

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """``{device: {bytes, ops, seconds, gbps}}``; ``gbps`` is bytes over the summed time
        of the loads (10**9 bytes per second), 0 before any timed load."""
        with self._lock:
            return {
                d: {
                    "bytes": c.nbytes,
                    "ops": c.ops,
                    "seconds": round(c.seconds, 9),
                    "gbps": round(c.nbytes / c.seconds / 1e9, 3) if c.seconds > 0 else 0.0,
                }
                for d, c in sorted(self._by.items())
            }

    def reset(self) -> None:
        with self._lock:
            self._by.clear()
