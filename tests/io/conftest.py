"""Fixtures of the data-path tests: one suite, run on every device and backend available."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tiering.config import TierConfig
from tiering.io import GdsConfig, GpuDirectStorage, TierIo

KiB = 1 << 10


def cuda_ok() -> bool:
    try:
        cp = importlib.import_module("cupy")
        return int(cp.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


def kvikio_ok() -> bool:
    try:
        importlib.import_module("kvikio")
        return True
    except Exception:
        return False


def _to_numpy(arr: Any) -> np.ndarray:
    if hasattr(arr, "__cuda_array_interface__"):
        return importlib.import_module("cupy").asnumpy(arr)
    return np.asarray(arr)


@pytest.fixture
def to_numpy() -> Any:
    """Copy any result array (NumPy or CuPy) to a NumPy array."""
    return _to_numpy


# (device, backend) pairs; GPU ones carry the gpu mark and skip without CUDA.
_TARGETS = [
    pytest.param(("cpu", "auto"), id="cpu"),
    pytest.param(("cuda:0", "auto"), id="cuda-auto", marks=pytest.mark.gpu),
    pytest.param(("cuda:0", "host"), id="cuda-host", marks=pytest.mark.gpu),
]

# Small tasks and a few threads, so that small test files still run the parallel path.
SMALL_IO = TierIo(threads=4, task_size=64 * KiB)


@pytest.fixture
def tiers(tmp_path: Path) -> list[TierConfig]:
    out = []
    for name in ("nvme", "ssd", "hdd"):
        (tmp_path / name).mkdir()
        out.append(TierConfig(name, tmp_path / name))
    return out


@pytest.fixture(params=_TARGETS)
def target(request: pytest.FixtureRequest) -> tuple[str, str]:
    device, backend = request.param
    if device.startswith("cuda") and not cuda_ok():
        pytest.skip("needs CuPy and a CUDA device")
    return device, backend


@pytest.fixture
def storage(target: tuple[str, str], tiers: list[TierConfig]) -> Iterator[GpuDirectStorage]:
    device, backend = target
    config = GdsConfig(
        backend=backend,  # type: ignore[arg-type]
        fast_tier_io=SMALL_IO,
        slow_tier_io=TierIo(threads=2, task_size=128 * KiB, direct=False),
        gather_threads=4,
        prefetch_batch_size=64 * KiB,
    )
    with GpuDirectStorage(device, config, tiers) as gds:
        yield gds


@pytest.fixture
def cpu_storage(tiers: list[TierConfig]) -> Iterator[GpuDirectStorage]:
    config = GdsConfig(fast_tier_io=SMALL_IO, gather_threads=4, prefetch_batch_size=64 * KiB)
    with GpuDirectStorage("cpu", config, tiers) as gds:
        yield gds


def _write_random(path: Path, size: int, seed: int = 0) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    return data


@pytest.fixture
def write_random() -> Any:
    """``write_random(path, size, seed=0)``: a file of random bytes; returns them."""
    return _write_random


@pytest.fixture
def device_empty(storage: GpuDirectStorage) -> Any:
    """``device_empty(nbytes)``: an uninitialised uint8 buffer on the storage's device."""
    return storage.device.empty
