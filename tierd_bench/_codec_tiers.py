"""The codec bench's reads through tiers: a checkpoint stored on a plain and on a compressing
directory tier, read back whole from the page cache (the rows the GPU module extends); and
whole-file loads from any tier into a device (:func:`load_times`, the GPU and object rows)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._measure import MiB, free_gpu, gbps, timed
from ._report import BenchRow, Report

if TYPE_CHECKING:
    from tiering.tiers import DirectoryTier, Tier

__all__ = ["load_times", "store", "tier_reads"]


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


def load_times(
    tier: Tier,
    relpath: str,
    data: bytes,
    device: str,
    config: Any,
    repeats: int,
    *,
    cold: Path | None = None,
) -> tuple[float, set[str]]:
    """Median seconds of whole-file loads of ``relpath`` (holding ``data``) from ``tier`` into
    ``device`` (``cuda:N`` or ``cpu``) through tierd's I/O layer, as a load opens it (its local
    file where it has one, else its range reader), and the engines that moved the bytes.
    The first load warms (the page cache, the decoder's buffers, a kernel) and is checked;
    with ``cold`` (the stored file), each timed load starts with it out of the page cache."""
    import importlib

    from tiering.io import GpuDirectStorage

    from ._datafiles import drop_cache

    cuda = device.startswith("cuda")
    cp = importlib.import_module("cupy") if cuda else None
    engines: set[str] = set()
    try:
        with GpuDirectStorage(device, config) as gds:

            def load() -> Any:
                src = tier.open(relpath)
                lf = src.local_file()
                if lf is not None:
                    src.close()
                    f = gds.open_file(lf.path)
                else:
                    f = gds.open_source(src, tier=tier.name, rank=0)
                with f:
                    r = gds.read(f)
                    if cp is not None:
                        cp.cuda.runtime.deviceSynchronize()
                engines.add(str(r.report.engine or "local"))
                return r.array

            got = load()
            host = cp.asnumpy(got) if cp is not None else np.asarray(got)
            if host.tobytes() != data:
                raise AssertionError(f"{relpath} on {tier.name}: the bytes loaded differ")
            del got, host
            free_gpu()
            drop = None if cold is None else lambda: drop_cache(cold)
            return timed(load, repeats, warmup=0, before=drop), engines
    finally:
        free_gpu()
