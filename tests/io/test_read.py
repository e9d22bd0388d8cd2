"""Loads and reads, checked against the file's bytes, on every device and backend."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

from tiering.config import TierConfig
from tiering.io import GdsFile, GpuDirectStorage, IoReport

SIZES = [0, 1, 4095, 4096, 4097, (3 << 20) + 5]


@pytest.mark.parametrize("size", SIZES)
def test_read_whole_file_matches_bytes(storage, tiers, write_random, to_numpy, size):
    data = write_random(tiers[0].path / "f.bin", size)
    with storage.open_file(tiers[0].path / "f.bin") as f:
        assert f.size() == size
        assert f.is_aligned() == (size % 4096 == 0)
        result = storage.read(f)
    assert result.array.dtype == np.uint8
    assert to_numpy(result.array).tobytes() == data.tobytes()
    assert result.report.nbytes == size
    assert result.report.tier == "nvme"
    assert result.report.io_path in ("gds", "compat", "host")


@pytest.mark.parametrize(("offset", "length"), [(0, 1), (1, 4095), (4095, 4097), (12345, 1 << 20)])
def test_read_ranges_and_dtype(storage, tiers, write_random, to_numpy, offset, length):
    data = write_random(tiers[0].path / "f.bin", (2 << 20) + 7)
    with storage.open_file(tiers[0].path / "f.bin") as f:
        got = storage.read(f, offset, length)
        assert to_numpy(got.array).tobytes() == data[offset : offset + length].tobytes()
        as_u32 = storage.read(f, 4, 4096, dtype="uint32").array
        assert to_numpy(as_u32).tobytes() == data[4 : 4 + 4096].tobytes()
        assert as_u32.dtype == np.uint32 and as_u32.shape == (1024,)


def test_load_to_gpu_fills_buffer(storage, tiers, write_random, to_numpy, device_empty):
    data = write_random(tiers[0].path / "f.bin", (1 << 20) + 4097)
    buf = device_empty(600_001)
    with storage.open_file(tiers[0].path / "f.bin") as f:
        report = storage.load_to_gpu(f, 4097, buf)
    assert isinstance(report, IoReport) and int(report) == 600_001
    assert report.gbps > 0
    assert to_numpy(buf).tobytes() == data[4097 : 4097 + 600_001].tobytes()


def test_tiers_pick_path_and_settings(storage, tiers, write_random, tmp_path):
    write_random(tiers[2].path / "cold.bin", 10_000)
    (tmp_path / "elsewhere").mkdir()
    write_random(tmp_path / "elsewhere" / "x.bin", 100)
    with storage.open_file(tiers[2].path / "cold.bin") as f:
        assert (f.tier, f.rank) == ("hdd", 2)
        # Slower tiers never take the direct path.
        assert f.io_path in ("compat", "host")
        storage.read(f)
    with storage.open_file(tmp_path / "elsewhere" / "x.bin") as f:
        assert f.tier is None and f.tier_key == "untiered"
        storage.read(f)
    stats = storage.stats()
    assert set(stats.by_tier) == {"hdd", "untiered"}
    assert stats.by_tier["hdd"].bytes_transferred == 10_000
    assert stats.bytes_transferred == 10_100
    assert stats.operations_completed == 2
    assert sum(p.bytes_transferred for p in stats.by_path.values()) == 10_100


def test_stats_count_failures_and_reset(storage, tiers, write_random):
    write_random(tiers[0].path / "f.bin", (2 << 20) + 1)
    with storage.open_file(tiers[0].path / "f.bin") as f:
        storage.read(f)
        # The file shrinks under us: the read fails, and is counted as failed.
        (tiers[0].path / "f.bin").write_bytes(b"x")
        with pytest.raises(Exception, match="ended early|truncated|short|read"):
            storage.read(f)
    s = storage.stats()
    assert s.operations_completed == 1 and s.operations_failed == 1
    assert s.peak_bandwidth_gbps > 0 and s.effective_bandwidth_gbps > 0
    assert s.avg_latency_us > 0
    storage.reset_stats()
    s = storage.stats()
    assert (s.bytes_transferred, s.operations_completed, s.operations_failed) == (0, 0, 0)
    assert s.by_path == {} and s.by_tier == {}


def test_load_file_and_batch(storage, tiers, write_random, to_numpy):
    paths = [tiers[i % 2].path / f"m{i}.bin" for i in range(5)]
    datas = [write_random(p, 70_000 * (i + 1) + i, seed=i) for i, p in enumerate(paths)]
    batch = storage.load_models_batch(paths)
    assert list(batch) == paths
    for p, d in zip(paths, datas, strict=True):
        assert to_numpy(batch[p]).tobytes() == d.tobytes()
        assert batch.reports[p].nbytes == d.size
    one = storage.load_file(paths[0])
    assert to_numpy(one.array).tobytes() == datas[0].tobytes()


def test_batch_with_a_missing_file_fails_whole(storage, tiers, write_random):
    from tiering.errors import FileNotFound

    write_random(tiers[0].path / "a.bin", 10)
    with pytest.raises(FileNotFound):
        storage.load_models_batch([tiers[0].path / "a.bin", tiers[0].path / "nope.bin"])


def test_async_twins(storage, tiers, write_random, to_numpy, device_empty):
    data = write_random(tiers[0].path / "f.bin", (1 << 20) + 3)

    async def main() -> None:
        f = await storage.aopen_file(tiers[0].path / "f.bin")
        try:
            got = await asyncio.gather(*(storage.aread(f, i * 1000, 5000) for i in range(8)))
            for i, r in enumerate(got):
                assert to_numpy(r.array).tobytes() == data[i * 1000 : i * 1000 + 5000].tobytes()
            buf = device_empty(4096)
            report = await storage.aload_to_gpu(f, 10, buf)
            assert report.nbytes == 4096
            assert to_numpy(buf).tobytes() == data[10:4106].tobytes()
            whole = await storage.aload_file(f)
            assert to_numpy(whole.array).tobytes() == data.tobytes()
            batch = await storage.aload_models_batch([tiers[0].path / "f.bin"])
            assert len(batch) == 1
        finally:
            f.close()

    asyncio.run(main())


def test_thread_safety_many_concurrent_readers(storage, tiers, write_random, to_numpy):
    data = write_random(tiers[0].path / "f.bin", (2 << 20) + 11)
    errors: list[BaseException] = []
    with storage.open_file(tiers[0].path / "f.bin") as f:

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                for _ in range(10):
                    off = int(rng.integers(0, data.size - 1))
                    n = int(rng.integers(1, min(300_000, data.size - off) + 1))
                    got = to_numpy(storage.read(f, off, n).array)
                    assert got.tobytes() == data[off : off + n].tobytes()
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    assert storage.stats().operations_completed == 80


def test_close_is_idempotent_and_file_repr(storage, tiers, write_random):
    write_random(tiers[0].path / "f.bin", 10)
    f = storage.open_file(tiers[0].path / "f.bin")
    assert isinstance(f, GdsFile) and "open" in repr(f)
    f.close()
    f.close()
    assert f.closed and "closed" in repr(f)


def test_default_settings_parallel_read_of_a_big_file(tmp_path, to_numpy):
    # The default settings (16 threads, 4 MiB tasks) on a file over the inline limit.
    data = np.arange((9 << 20) // 4, dtype=np.uint32).view(np.uint8)
    (tmp_path / "big.bin").write_bytes(data.tobytes())
    tiers = [TierConfig("nvme", tmp_path)]
    with GpuDirectStorage("cpu", tiers=tiers) as gds, gds.open_file(tmp_path / "big.bin") as f:
        got = gds.read(f, 3, data.size - 3)
    assert got.array.tobytes() == data[3:].tobytes()


def test_storage_is_usable_without_tiers(tmp_path: Path):
    (tmp_path / "f").write_bytes(b"hello")
    with GpuDirectStorage("cpu") as gds, gds.open_file(tmp_path / "f") as f:
        assert gds.read(f).array.tobytes() == b"hello"
        assert gds.tier_of(tmp_path / "f") is None


def test_a_memory_tier_above_nvme_leaves_nvme_the_fastest_storage_tier(tmp_path: Path):
    # The memory tier has no path and no rank among the storage tiers: nvme keeps rank 0 and
    # with it fast_tier_io's threads (rank 1 would get slow_tier_io's four).
    for name in ("nvme", "ssd"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_bytes(b"x")
    tiers = [
        TierConfig("ram", kind="memory", quota_bytes=1 << 20),
        TierConfig("nvme", tmp_path / "nvme"),
        TierConfig("ssd", tmp_path / "ssd"),
    ]
    with GpuDirectStorage("cpu", tiers=tiers) as gds:
        assert gds.tier_of(tmp_path / "nvme" / "f") == ("nvme", 0)
        assert gds.tier_of(tmp_path / "ssd" / "f") == ("ssd", 1)
        assert gds.config.io_for("nvme", 0) is gds.config.fast_tier_io
