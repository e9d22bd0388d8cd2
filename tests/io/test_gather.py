"""Vector reads and gathers: request order, duplicates, runs and scattered rows."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

DIM = 64  # 256-byte float32 rows


@pytest.fixture
def matrix(storage, tiers):
    rows = 5000
    m = np.random.default_rng(3).standard_normal((rows, DIM)).astype(np.float32)
    path = tiers[0].path / "vectors.f32"
    m.tofile(path)
    with storage.open_file(path) as f:
        yield m, f


def test_read_vectors(storage, matrix, to_numpy):
    m, f = matrix
    r = storage.read_vectors(f, 17, 1000, DIM, "float32")
    assert r.array.shape == (1000, DIM) and r.array.dtype == np.float32
    np.testing.assert_array_equal(to_numpy(r.array), m[17:1017])
    assert to_numpy(storage.read_vectors(f, 0, 0, DIM, np.float32).array).shape == (0, DIM)


@pytest.mark.parametrize(
    "pattern", ["scattered", "duplicates", "reverse", "runs", "single", "empty", "all"]
)
def test_gather_in_request_order(storage, matrix, to_numpy, pattern):
    m, f = matrix
    rng = np.random.default_rng(7)
    idx = {
        "scattered": rng.integers(0, len(m), 3000),
        "duplicates": np.array([5, 5, 4999, 0, 5, 0]),
        "reverse": np.arange(len(m))[::-1].copy(),
        "runs": np.concatenate([np.arange(100, 400), np.arange(10, 20), np.arange(4000, 4999)]),
        "single": np.array([4321]),
        "empty": np.array([], dtype=np.int64),
        "all": np.arange(len(m)),
    }[pattern]
    r = storage.gather(f, idx, DIM, "float32")
    assert r.array.shape == (len(idx), DIM)
    np.testing.assert_array_equal(to_numpy(r.array), m[idx])
    assert r.report.nbytes == len(idx) * DIM * 4


def test_prefetch_into_buffer(storage, matrix, to_numpy, device_empty):
    m, f = matrix
    idx = [3, 2, 1, 1000, 1001, 1002, 7]
    buf = device_empty(len(idx) * DIM * 4).view(np.float32).reshape(len(idx), DIM)
    report = storage.prefetch_vectors(f, idx, DIM, np.float32, buf)
    assert report.nbytes == buf.nbytes
    np.testing.assert_array_equal(to_numpy(buf), m[idx])


def test_gather_indices_from_list_and_other_int_types(storage, matrix, to_numpy):
    m, f = matrix
    for idx in ([9, 8, 7], np.array([9, 8, 7], np.uint16), np.array([[1, 2], [3, 4]])):
        r = storage.gather(f, idx, DIM, "float32")
        np.testing.assert_array_equal(to_numpy(r.array), m[np.asarray(idx).reshape(-1)])


def test_async_gather(storage, matrix, to_numpy, device_empty):
    m, f = matrix

    async def main():
        a, b = await asyncio.gather(
            storage.agather(f, [1, 2, 3], DIM), storage.aread_vectors(f, 10, 5, DIM)
        )
        np.testing.assert_array_equal(to_numpy(a.array), m[[1, 2, 3]])
        np.testing.assert_array_equal(to_numpy(b.array), m[10:15])
        buf = device_empty(2 * DIM * 4)
        await storage.aprefetch_vectors(f, [4, 0], DIM, "float32", buf)
        np.testing.assert_array_equal(to_numpy(buf).view(np.float32).reshape(2, DIM), m[[4, 0]])

    asyncio.run(main())


def test_plan_runs_coalesces_consecutive_rows():
    from tiering.io._gather import plan_runs

    first, length, pos = plan_runs(np.array([7, 8, 9, 3, 3, 4, 10]))
    assert first.tolist() == [7, 3, 3, 10]
    assert length.tolist() == [3, 1, 2, 1]
    assert pos.tolist() == [0, 3, 4, 6]
