"""The codec bench's reads through tiers: a checkpoint stored on a plain and on a compressing
directory tier, read back whole from the page cache (the rows the GPU module extends)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ._measure import MiB, gbps, timed
from ._report import BenchRow, Report

if TYPE_CHECKING:
    from tiering.tiers import DirectoryTier

__all__ = ["store", "tier_reads"]


def store(tier: DirectoryTier, data: bytes) -> None:
    """``data`` as ``model.safetensors`` on ``tier`` (checked, then written as a move would)."""
    tier.check()
    with tier.writer("model.safetensors") as w:
        for i in range(0, len(data), 8 * MiB):
            w.write(data[i : i + 8 * MiB])
        w.publish()


def tier_reads(report: Report, data: bytes, repeats: int, say: Callable[[str], None]) -> None:
    """A whole-file read of the checkpoint from the page cache, through a plain directory
    tier and through a compressing one (its source's decoding ranges, on its pool)."""
    from tiering.config import TierConfig
    from tiering.tiers import DirectoryTier

    buf = memoryview(bytearray(len(data)))
    with tempfile.TemporaryDirectory(prefix="tierd-bench-codec-") as tmp:
        for key, mode in (("read_raw", "off"), ("read_compressed", "on")):
            tier = DirectoryTier(TierConfig(mode, path=Path(tmp) / mode, compression=mode), 0)
            try:
                store(tier, data)

                def read(tier: DirectoryTier = tier) -> None:
                    with tier.open("model.safetensors") as src:
                        ranges = src.ranges
                        if ranges is not None:
                            ranges.readinto(buf, 0)
                        else:
                            src.readinto(buf, 0)

                secs = timed(read, repeats)
                if bytes(buf) != data:
                    raise AssertionError(f"{key}: the bytes read differ from the checkpoint")
            finally:
                tier.close()
            label = "read, page cache, " + ("compressed tier" if mode == "on" else "plain tier")
            report.add(BenchRow(key, label + " (model bytes)", gbps(len(data), secs), "GB/s"))
