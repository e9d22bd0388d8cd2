"""Reads of bytes already held in memory (:class:`tiering.io.CopyFile`): a memory tier's host
copy into ``cpu`` and into a GPU, a GPU-resident copy into the same GPU, another GPU and the
host. Each read is byte-identical and says where its bytes came from."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from tiering.errors import ClosedFile, InvalidRange
from tiering.io import GpuDirectStorage, parse_device

from .conftest import cuda_ok

gpu = pytest.mark.skipif(not cuda_ok(), reason="needs a CUDA GPU and cupy")


def _data(n: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)


def test_host_copy_into_cpu_is_counted_as_memory() -> None:
    data = _data(3 << 20)
    closed: list[bool] = []
    with GpuDirectStorage("cpu") as gds:
        f = gds.open_copy(
            data, parse_device("cpu"), name="m/a.bin", tier="nvme", rank=0,
            on_close=lambda: closed.append(True),
        )  # fmt: skip
        with f:
            got = gds.read(f, 1000, 2 << 20)
            assert np.array_equal(got.array, data[1000 : 1000 + (2 << 20)])
            assert (got.report.io_path, got.report.source, got.report.tier) == (
                "copy",
                "memory",
                "nvme",
            )
            assert f.read_bytes(8, 5) == data[5:13].tobytes()
            rows = gds.gather(f, [3, 0, 3], dim=4, dtype=np.uint8)
            assert np.array_equal(rows.array, data[:16].reshape(4, 4)[[3, 0, 3]])
            assert rows.report.source == "memory"
            with pytest.raises(InvalidRange):
                gds.read(f, len(data) - 1, 2)
        assert closed == [True]
        with pytest.raises(ClosedFile):
            gds.read(f)
        snap = gds.stats()
        assert snap.by_source["memory"].bytes_transferred == (2 << 20) + 12
        assert snap.by_tier_source["nvme/memory"].operations_completed == 2


def test_the_holders_array_is_never_written_through_rows() -> None:
    data = _data(4096)
    with (
        GpuDirectStorage("cpu") as gds,
        gds.open_copy(data, parse_device("cpu"), name="x", tier=None, rank=None) as f,
    ):
        rows = f._rows(populate=False)
        with pytest.raises(ValueError):
            rows[0] = 1


@gpu
@pytest.mark.gpu
def test_copies_into_gpus_are_byte_identical() -> None:
    cp = importlib.import_module("cupy")
    data = _data(64 << 20)
    n_dev = int(cp.cuda.runtime.getDeviceCount())
    pinned = cp.cuda.alloc_pinned_memory(data.nbytes)
    host = np.frombuffer(pinned, dtype=np.uint8, count=data.nbytes)
    host[:] = data
    with GpuDirectStorage("cuda:0") as gds:
        with gds.open_copy(host, parse_device("cpu"), name="h", tier="nvme", rank=0) as f:
            got = gds.read(f, 4096, 32 << 20)
            assert got.report.source == "memory"
            assert np.array_equal(cp.asnumpy(got.array), data[4096 : 4096 + (32 << 20)])
        with cp.cuda.Device(0):
            on0 = cp.asarray(data)
            # A holder hands out copies whose bytes have landed; the upload is async.
            cp.cuda.Device(0).synchronize()
        with gds.open_copy(on0, parse_device("cuda:0"), name="g", tier="nvme", rank=0) as f:
            got = gds.read(f)
            assert got.report.source == "gpu"
            assert np.array_equal(cp.asnumpy(got.array), data)
        with (
            GpuDirectStorage("cpu") as host_gds,
            host_gds.open_copy(on0, parse_device("cuda:0"), name="g", tier="nvme", rank=0) as f,
        ):
            got = host_gds.read(f, 10, 1000)
            assert got.report.source == "gpu"
            assert np.array_equal(got.array, data[10:1010])
        if n_dev > 1:
            with cp.cuda.Device(1):
                on1 = cp.asarray(data)
                cp.cuda.Device(1).synchronize()
            with gds.open_copy(on1, parse_device("cuda:1"), name="p", tier="nvme", rank=0) as f:
                got = gds.read(f, 1 << 20)
                assert got.report.source == "peer"
                assert np.array_equal(cp.asnumpy(got.array), data[1 << 20 :])


@gpu
@pytest.mark.gpu
def test_shards_held_on_the_device_load_on_the_callers_thread() -> None:
    """A load of safetensors shards whose copies are on the device queues one copy per shard:
    it runs on the caller's thread, where the I/O threads' hand-off cost more than the copies
    (a restarted engine's plain load of its kept copies). The bytes are the files'."""
    import threading

    from safetensors.numpy import save

    cp = importlib.import_module("cupy")
    rng = np.random.default_rng(3)
    shards = [{f"s{i}.w{j}": rng.random((64, 32), dtype=np.float32) for j in range(3)}
              for i in range(3)]  # fmt: skip
    threads: list[int] = []
    with GpuDirectStorage("cuda:0") as gds:
        dev = parse_device("cuda:0")

        def alloc(n: int) -> object:
            threads.append(threading.get_ident())
            return dev.empty(n)

        files = []
        for i, tensors in enumerate(shards):
            raw = np.frombuffer(save(tensors), dtype=np.uint8)
            head = 8 + int.from_bytes(raw[:8].tobytes(), "little")
            on0 = cp.asarray(raw[head:])
            cp.cuda.Device(0).synchronize()
            files.append(
                gds.open_copy(on0, dev, name=f"m/s{i}.safetensors", tier="nvme", rank=0,
                              head=raw[:head].tobytes())
            )  # fmt: skip
        try:
            out = gds.load_safetensors_raw(files, None, alloc)
        finally:
            for f in files:
                f.close()
    assert threads == [threading.get_ident()] * 3
    for shard, tensors in zip(out, shards, strict=True):
        assert shard.report.source == "gpu"
        for name, want in tensors.items():
            at, info = shard.tensors[name]
            got = cp.asnumpy(shard.buffer[at : at + want.nbytes]).view(np.float32)
            assert np.array_equal(got.reshape(want.shape), want)
