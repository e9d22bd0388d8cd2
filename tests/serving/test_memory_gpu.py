"""The memory tier on a GPU host: its copies are cudaHostAlloc'd (page-locked, known to CUDA
as host memory), and a load into ``cuda:0`` from one is a host → device copy, byte-identical,
with source ``memory``; and a gather into cuda reads the copy's rows."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import put
from tests.placement.memory_support import MiB, memory_settings
from tiering.engine import Engine
from tiering.serving import Loader, LoaderConfig

pytestmark = pytest.mark.gpu

_HOST = 1  # cudaMemoryTypeHost: page-locked host memory CUDA knows of


def test_memory_fill_is_pinned_by_cuda_and_loads_into_cuda(tmp_path: Path) -> None:
    import cupy as cp

    from tiering.tiers._pinned import pinning_backend

    assert pinning_backend() == "cuda"
    data = os.urandom(64 * MiB + 3 * 4096)  # whole rows of 1024 float32, for the gather
    settings = memory_settings(tmp_path / "data", quota=256 * MiB)
    with Engine(settings.engine_config()) as eng:
        rec = put(eng, "w.bin", data, tier="ssd")
        assert eng.memory is not None
        entry = eng.memory.fill(rec.id)
        assert entry.alloc.backend == "cuda" and entry.pinned_memory
        attrs = cp.cuda.runtime.pointerGetAttributes(entry.view().ctypes.data)
        assert attrs.type == _HOST
        ld = Loader(eng, LoaderConfig(gpu_budget_bytes=512 * MiB)).start()
        try:
            lease = ld.load(rec.id, device="cuda:0")
            assert lease.report is not None and lease.report.source == "memory"
            got = cp.asnumpy(lease.buffer.array()[lease.offset : lease.offset + lease.nbytes])
            assert got.tobytes() == data
            ld.leases.release(lease.id)
            part = ld.load(rec.id, offset=MiB + 3, length=5 * MiB, device="cuda:0")
            assert part.report is not None and part.report.source == "memory"
            got = cp.asnumpy(part.buffer.array()[part.offset : part.offset + part.nbytes])
            assert got.tobytes() == data[MiB + 3 : 6 * MiB + 3]
            ld.leases.release(part.id)
            rows = np.frombuffer(data, np.float32).reshape(-1, 1024)
            g = ld.gather(rec.id, dim=1024, indices=[5, 0, 7, 5], device="cuda:0")
            got = cp.asnumpy(g.buffer.array()[g.offset : g.offset + g.nbytes])
            assert got.tobytes() == rows[[5, 0, 7, 5]].tobytes()
            ld.leases.release(g.id)
        finally:
            ld.stop()
        assert entry.refs == 0
