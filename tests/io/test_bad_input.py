"""Every bad input gets its typed error, and leaves nothing behind."""

from __future__ import annotations

import numpy as np
import pytest

from tiering.errors import (
    ClosedFile,
    FileNotFound,
    IndexOutOfRange,
    InvalidDevice,
    InvalidDtype,
    InvalidInput,
    InvalidRange,
    MisalignedBuffer,
)
from tiering.io import GdsConfig, GpuDirectStorage, parse_device


@pytest.fixture
def f(storage, tiers, write_random):
    write_random(tiers[0].path / "m.bin", 64 * 1024)  # 16 rows of 1024 float32
    with storage.open_file(tiers[0].path / "m.bin") as fh:
        yield fh


@pytest.mark.parametrize(
    ("offset", "length"),
    [(-1, 10), (0, 64 * 1024 + 1), (64 * 1024 + 1, None), (64 * 1024, 1), (10, -1), (1.5, 2)],
)
def test_range_outside_file(storage, f, offset, length):
    with pytest.raises(InvalidRange):
        storage.read(f, offset, length)


def test_load_past_end(storage, f, device_empty):
    with pytest.raises(InvalidRange):
        storage.load_to_gpu(f, 60 * 1024, device_empty(8 * 1024))
    with pytest.raises(InvalidRange):
        storage.load_to_gpu(f, -4096, device_empty(4096))


@pytest.mark.parametrize("dtype", ["float7", object, "U4", "M8[s]", ",", "i4,("])
def test_unknown_dtype(storage, f, dtype):
    with pytest.raises(InvalidDtype):
        storage.read(f, 0, 4096, dtype=dtype)


def test_dtype_that_does_not_divide(storage, f):
    with pytest.raises(InvalidDtype):
        storage.read(f, 0, 4095, dtype="float32")
    with pytest.raises(InvalidDtype):  # 65536 bytes is not a whole number of 3 x f32 rows
        storage.read_vectors(f, 0, 1, 3, "float32")


def test_misaligned_buffer_when_alignment_required(target, tiers, write_random, to_numpy):
    device, backend = target
    write_random(tiers[0].path / "f.bin", 64 * 1024)
    config = GdsConfig(backend=backend, require_alignment=True)  # type: ignore[arg-type]
    with (
        GpuDirectStorage(device, config, tiers) as gds,
        gds.open_file(tiers[0].path / "f.bin") as fh,
    ):
        aligned = gds.device.empty(3 * 4096 + 4096)
        base = int(aligned.data.ptr) if gds.device.is_cuda else aligned.ctypes.data
        skip = (-base) % 4096
        good = aligned[skip : skip + 2 * 4096]
        assert gds.load_to_gpu(fh, 4096, good).nbytes == 8192
        with pytest.raises(MisalignedBuffer):
            gds.load_to_gpu(fh, 100, good)  # offset
        with pytest.raises(MisalignedBuffer):
            gds.load_to_gpu(fh, 0, good[:4000])  # length
        with pytest.raises(MisalignedBuffer):
            gds.load_to_gpu(fh, 0, aligned[skip + 1 : skip + 1 + 4096])  # address


def test_non_contiguous_or_readonly_buffer(storage, f, device_empty):
    buf = device_empty(8192)
    with pytest.raises(MisalignedBuffer):
        storage.load_to_gpu(f, 0, buf[::2])
    if not storage.device.is_cuda:
        ro = np.zeros(16, np.uint8)
        ro.flags.writeable = False
        with pytest.raises(InvalidInput):
            storage.load_to_gpu(f, 0, ro)


def test_buffer_on_the_wrong_device(storage, f):
    if storage.device.is_cuda:
        with pytest.raises(InvalidDevice):
            storage.load_to_gpu(f, 0, np.zeros(16, np.uint8))
    else:
        with pytest.raises(InvalidInput):
            storage.load_to_gpu(f, 0, object())


def test_closed_file(storage, f, device_empty):
    f.close()
    for call in (
        lambda: storage.read(f),
        lambda: storage.load_to_gpu(f, 0, device_empty(16)),
        lambda: storage.read_vectors(f, 0, 1, 1024, "float32"),
        lambda: storage.gather(f, [1], 1024, "float32"),
    ):
        with pytest.raises(ClosedFile):
            call()


@pytest.mark.parametrize("device", ["gpu:0", "cuda:-1", "cuda:x", "tpu", "", -1, True, 1.0])
def test_device_that_does_not_exist(device):
    with pytest.raises(InvalidDevice):
        parse_device(device)


@pytest.mark.gpu
def test_cuda_index_that_does_not_exist():
    with pytest.raises(InvalidDevice):
        GpuDirectStorage("cuda:99")


def test_missing_file_and_directory(storage, tiers):
    with pytest.raises(FileNotFound):
        storage.open_file(tiers[0].path / "nope.bin")
    with pytest.raises(FileNotFound):
        storage.open_file(tiers[0].path)


@pytest.mark.parametrize("idx", [[-1], [16], [0, 3, 99], np.array([2**40])])
def test_indices_out_of_range(storage, f, idx, device_empty):
    with pytest.raises(IndexOutOfRange):
        storage.gather(f, idx, 1024, "float32")
    with pytest.raises(IndexOutOfRange):
        storage.prefetch_vectors(f, idx, 1024, "float32", device_empty(len(idx) * 4096))


@pytest.mark.parametrize(("start", "count"), [(-1, 1), (15, 2), (17, 0), (0, 17)])
def test_vector_range_out_of_range(storage, f, start, count):
    with pytest.raises(IndexOutOfRange):
        storage.read_vectors(f, start, count, 1024, "float32")


def test_bad_indices_and_dims(storage, f, device_empty):
    with pytest.raises(InvalidInput):
        storage.gather(f, [0.5], 1024, "float32")
    with pytest.raises(InvalidInput):
        storage.gather(f, [0], 0, "float32")
    with pytest.raises(InvalidRange):  # buffer holds 1 row, 2 asked
        storage.prefetch_vectors(f, [0, 1], 1024, "float32", device_empty(4096))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"backend": "nope"},
        {"alignment": 3000},
        {"max_concurrent_ops": 0},
        {"thread_pool_size": -1},
        {"cold_threshold": 2.0},
    ],
)
def test_bad_config(kwargs):
    with pytest.raises(InvalidInput):
        GdsConfig(**kwargs)


def test_bad_input_leaves_no_stats(storage, f):
    with pytest.raises(InvalidRange):
        storage.read(f, 0, 1 << 30)
    assert storage.stats().operations_completed == 0
    assert storage.stats().operations_failed == 0
