"""Released GPU buffers are kept for the next lease of their size, up to the device's budget
by default: a reload of a shard larger than any fixed cap reuses its allocation, and a new
lease that needs the room frees idle buffers first, so leased plus idle never exceeds the
budget."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import engine_settings, put
from tiering.engine import Engine
from tiering.serving import Loader, LoaderConfig

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def test_released_buffers_are_reused_up_to_the_budget(tmp_path: Path) -> None:
    pytest.importorskip("cupy")
    small, large = os.urandom(24 * MiB), os.urandom(48 * MiB)
    with Engine(engine_settings(tmp_path / "d").engine_config()) as eng:
        a = put(eng, "a.bin", small)
        b = put(eng, "b.bin", large)
        # The default cap is the budget itself; 24 MiB is above the old fixed cap's share.
        ld = Loader(eng, LoaderConfig(gpu_budget_bytes=64 * MiB)).start()
        try:
            pool = ld.leases.pool
            first = ld.load(a.id, device="cuda:0")
            ptr = first.buffer.array().data.ptr
            ld.leases.release(first.id)
            assert pool.idle_bytes() == {"cuda:0": 24 * MiB}
            again = ld.load(a.id, device="cuda:0")
            assert again.buffer.array().data.ptr == ptr  # the same allocation, no cudaMalloc
            assert pool.idle_bytes() == {"cuda:0": 0}
            ld.leases.release(again.id)
            # 48 MiB leased + 24 MiB idle would pass the 64 MiB budget: the idle one goes.
            big = ld.load(b.id, device="cuda:0")
            assert pool.idle_bytes() == {"cuda:0": 0}
            assert ld.leases.leased_bytes()["cuda:0"] == 48 * MiB
            ld.leases.release(big.id)
            assert pool.idle_bytes() == {"cuda:0": 48 * MiB}
        finally:
            ld.stop()
