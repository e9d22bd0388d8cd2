"""``tierd bench codec --device cuda:N``: compressed files into GPU memory (issue 29).

The same checkpoint, in the page cache, three ways into one GPU, in one run (then plain and
compressed again, each load from the disk: the page cache dropped before it):

- stored plain, loaded by tierd (the path a compressed tier replaces), beside the pinned
  host → device copy, the ceiling of any load of raw bytes;
- stored compressed, its stored bytes moved and decoded on the GPU by nvCOMP;
- stored compressed, decoded on the host and the logical bytes copied (``gpu_decode`` off:
  what a host without nvCOMP gets).

Rates are of model (logical) bytes. Every load is checked equal to the checkpoint.
"""

from __future__ import annotations

import importlib
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ._measure import GiB, free_gpu, gbps, timed
from ._report import BenchRow, Report

__all__ = ["gpu_rows"]


def gpu_rows(
    report: Report, data: bytes, device: str, repeats: int, say: Callable[[str], None]
) -> None:
    """Add the GPU rows for ``data`` loaded into ``device`` (see the module)."""
    from tiering.io import GdsConfig
    from tiering.io import gpu_decode_available as available

    why = available()
    report.setup["gpu_decode"] = why or "nvCOMP"
    say("pinned ceiling")
    report.add(
        BenchRow(
            "gpu_ceiling",
            "pinned host -> device copy",
            _ceiling(device, len(data), repeats),
            "GB/s",
        )
    )
    free_gpu()
    with tempfile.TemporaryDirectory(prefix="tierd-bench-codec-gpu-") as tmp:
        # (key, compression, label, decoded on the GPU, cold). Cold: the stored file read from
        # the disk each time (the slow-tier case compression is for: the disk is the limit).
        rows = (
            ("gpu_plain", "off", "plain tier -> GPU, tierd load", True, False),
            ("gpu_nvcomp", "on", "compressed tier -> GPU, decoded on the GPU", True, False),
            ("gpu_host_decode", "on", "compressed tier -> GPU, decoded on the host", False, False),
            ("gpu_plain_cold", "off", "plain tier -> GPU, cold (from the disk)", True, True),
            (
                "gpu_nvcomp_cold",
                "on",
                "compressed tier -> GPU, cold, decoded on the GPU",
                True,
                True,
            ),
        )
        for key, mode, label, on_gpu, cold in rows:
            if mode == "on" and on_gpu and why is not None:
                report.add(BenchRow(key, label, None, "GB/s", note=why))
                continue
            say(label)
            config = GdsConfig(gpu_decode=on_gpu)
            secs, engines = _loads(Path(tmp) / key, mode, data, device, config, repeats, cold=cold)
            note = f"engine {', '.join(sorted(engines))}"
            report.add(BenchRow(key, label, gbps(len(data), secs), "GB/s", note=note))
    report.compare("gpu_plain", "gpu_ceiling")
    report.compare("gpu_nvcomp", "gpu_plain")
    report.compare("gpu_host_decode", "gpu_plain")
    report.compare("gpu_nvcomp_cold", "gpu_plain_cold")


def _ceiling(device: str, size: int, repeats: int) -> float:
    """GB/s of a pinned host -> device copy of up to 1 GiB."""
    cp = importlib.import_module("cupy")
    n = min(GiB, size)
    host = cp.cuda.alloc_pinned_memory(n)
    src = np.frombuffer(host, np.uint8, n)
    src[:] = 1
    with cp.cuda.Device(int(device.split(":")[1])) as dev:
        dst = cp.empty(n, cp.uint8)
        # More runs than elsewhere: each is short, and this figure is the yardstick.
        return gbps(n, timed(lambda: dst.set(src), max(5, repeats), sync=dev.synchronize))


def _loads(
    root: Path,
    mode: str,
    data: bytes,
    device: str,
    config: Any,
    repeats: int,
    *,
    cold: bool = False,
) -> tuple[float, set[str]]:
    """Median seconds of whole-file loads of ``data`` from a tier at ``root`` whose
    ``compression`` is ``mode`` into ``device`` (``cold``: each from the disk), and the
    engines that moved the bytes."""
    from tiering.config import TierConfig
    from tiering.tiers import DirectoryTier

    from ._codec_tiers import load_times, store

    tier = DirectoryTier(TierConfig(mode, path=root, compression=mode), 0)
    try:
        store(tier, data)
        path = root / "model.safetensors" if cold else None
        return load_times(tier, "model.safetensors", data, device, config, repeats, cold=path)
    finally:
        tier.close()
