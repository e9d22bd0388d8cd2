"""How tierd's own HTTP connections bound a read (:mod:`tiering.io._remote_http`): lanes that
bound the GETs in flight and stop after a failure, and the pinned pieces of reads into GPU
memory, bounded however many threads read."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from tests.io.conftest import cuda_ok
from tiering.io._remote_http import Stagings, _in_lanes

KiB, MiB = 1 << 10, 1 << 20


def test_lanes_bound_the_gets_in_flight_and_stop_after_a_failure() -> None:
    pool = ThreadPoolExecutor(16)
    ranges = SimpleNamespace(pool=pool)
    lock = threading.Lock()
    now, most, done = [0], [0], []

    def one(off: int, n: int, at: int) -> None:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.002)
        with lock:
            now[0] -= 1
            done.append(off)

    try:
        _in_lanes(ranges, 3, [(i, 1, i) for i in range(40)], one)  # type: ignore[arg-type]
        assert sorted(done) == list(range(40)) and most[0] <= 3

        done.clear()

        def fails_at_5(off: int, n: int, at: int) -> None:
            if off == 5:
                raise OSError("the fifth GET")
            one(off, n, at)

        with pytest.raises(OSError, match="fifth"):
            _in_lanes(ranges, 2, [(i, 1, i) for i in range(200)], fails_at_5)  # type: ignore[arg-type]
        assert len(done) < 20  # no lane took another GET once the failure was seen
    finally:
        pool.shutdown()


@pytest.mark.gpu
def test_pinned_pieces_are_bounded_and_a_take_waits_for_a_piece_given_back() -> None:
    if not cuda_ok():
        pytest.skip("needs CuPy and a CUDA device")
    import cupy as cp

    stagings = Stagings(1 * MiB, 2)
    a, b = stagings.take(cp), stagings.take(cp)
    assert a is not b
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(stagings.take(cp)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # both pieces are out: no third is made
    dev = cp.zeros(1 * MiB, cp.uint8)
    a.views[0][:] = 7
    a.copy_out(cp, 0, int(dev.data.ptr), 0, 1 * MiB)
    a.mark(cp, 0)
    stagings.give(a)
    waiter.join(5)
    assert got == [a]  # the piece given back, once its copy had landed
    assert int(dev.sum()) == 7 * MiB
    stagings.give(b)
    assert stagings.take(cp) is b
