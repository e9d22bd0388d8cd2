"""safetensors: files written by the safetensors package, subsets, shards, bad headers."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tiering.errors import InvalidDtype, InvalidInput, MalformedFile
from tiering.io import read_header

ALL_DTYPES = {
    "b": np.array([True, False, True]),
    "u8": np.arange(7, dtype=np.uint8),
    "i8": np.arange(-3, 4, dtype=np.int8),
    "i16": np.arange(-5, 5, dtype=np.int16).reshape(2, 5),
    "u16": np.arange(9, dtype=np.uint16),
    "f16": np.linspace(0, 1, 6, dtype=np.float16).reshape(3, 2),
    "i32": np.arange(11, dtype=np.int32),
    "u32": np.arange(3, dtype=np.uint32),
    "f32": np.random.default_rng(0).standard_normal((4, 5, 6)).astype(np.float32),
    "i64": np.arange(5, dtype=np.int64),
    "u64": np.arange(2, dtype=np.uint64),
    "f64": np.linspace(-1, 1, 13),
    "scalar": np.array(3.5, dtype=np.float32),
    "empty": np.zeros((0, 4), dtype=np.float32),
}


def _raw_file(path: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def test_all_numpy_dtypes_from_the_safetensors_package(storage, tiers, to_numpy):
    path = tiers[0].path / "model.safetensors"
    save_file(ALL_DTYPES, str(path), metadata={"format": "np"})
    header = read_header(path)
    assert header.metadata == {"format": "np"}
    loaded = storage.load_safetensors(path)
    assert set(loaded) == set(ALL_DTYPES)
    for name, want in ALL_DTYPES.items():
        got = to_numpy(loaded[name])
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want)
    report = loaded.reports[path]
    assert report.tier == "nvme" and report.nbytes == sum(a.nbytes for a in ALL_DTYPES.values())


def test_subset_and_many_shards(storage, tiers, to_numpy):
    rng = np.random.default_rng(1)
    shards, want = [], {}
    for s in range(3):
        tensors = {f"s{s}.t{i}": rng.standard_normal((64, 33)).astype(np.float32) for i in range(6)}
        want.update(tensors)
        path = tiers[s % 2].path / f"model-{s:05d}.safetensors"
        save_file(tensors, str(path))
        shards.append(path)
    everything = storage.load_safetensors(shards)
    assert set(everything) == set(want)
    assert set(everything.reports) == set(shards)
    for k, v in want.items():
        np.testing.assert_array_equal(to_numpy(everything[k]), v)
    # A sparse subset is read tensor by tensor into one packed allocation per shard.
    names = ["s0.t0", "s0.t5", "s2.t3"]
    subset = storage.load_safetensors(shards, names=names)
    assert sorted(subset) == sorted(names)
    for k in names:
        np.testing.assert_array_equal(to_numpy(subset[k]), want[k])
    assert subset.reports[shards[1]].nbytes == 0
    with pytest.raises(InvalidInput):
        storage.load_safetensors(shards, names=["nope"])


def test_bf16_and_f8_are_raw_bits_without_ml_dtypes(storage, tiers, to_numpy, monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    bf16 = np.array([0x3F80, 0x4000, 0xBF80], dtype=np.uint16)  # 1.0, 2.0, -1.0
    f8 = np.array([0x38, 0x40, 0x00, 0xB8], dtype=np.uint8)
    data = bf16.tobytes() + f8.tobytes() + f8.tobytes()
    header = {
        "w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
        "e4m3": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [6, 10]},
        "e5m2": {"dtype": "F8_E5M2", "shape": [4], "data_offsets": [10, 14]},
    }
    path = tiers[0].path / "low.safetensors"
    _raw_file(path, header, data)
    loaded = storage.load_safetensors(path)
    assert loaded.dtypes == {"w": "BF16", "e4m3": "F8_E4M3", "e5m2": "F8_E5M2"}
    w = to_numpy(loaded["w"])
    assert w.dtype == np.uint16 and w.tolist() == bf16.tolist()
    e = to_numpy(loaded["e4m3"])
    assert e.dtype == np.uint8 and e.shape == (2, 2) and e.reshape(-1).tolist() == f8.tolist()


def test_bf16_with_ml_dtypes(cpu_storage, tiers):
    ml = pytest.importorskip("ml_dtypes")
    path = tiers[0].path / "bf.safetensors"
    _raw_file(
        path,
        {"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}},
        np.array([0x3F80, 0x4000], np.uint16).tobytes(),
    )
    w = cpu_storage.load_safetensors(path)["w"]
    assert w.dtype == ml.bfloat16 and w.astype(np.float32).tolist() == [1.0, 2.0]


@pytest.mark.gpu
def test_torch_framework_gets_real_dtypes(tiers):
    torch = pytest.importorskip("torch")
    from tiering.io import GpuDirectStorage

    path = tiers[0].path / "t.safetensors"
    _raw_file(
        path,
        {
            "w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
            "f": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
        },
        np.array([0x3F80, 0x4000], np.uint16).tobytes() + np.float32(7).tobytes(),
    )
    with GpuDirectStorage("cuda:0", tiers=tiers) as gds:
        out = gds.load_safetensors(path, framework="torch")
    assert out["w"].dtype == torch.bfloat16 and out["w"].device.type == "cuda"
    assert out["w"].float().tolist() == [1.0, 2.0]
    assert out["f"].tolist() == [7.0]


def _bad_files(tmp: Path) -> dict[str, Path]:
    files = {}
    good = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}

    def make(name, blob):
        p = tmp / f"{name}.safetensors"
        p.write_bytes(blob)
        files[name] = p

    make("empty", b"")
    make("short_length", b"\x10\x00\x00")
    make("length_past_end", struct.pack("<Q", 1000) + b"{}")
    make("huge_length", struct.pack("<Q", 2**60) + b"{}")
    make("not_json", struct.pack("<Q", 4) + b"{no}")
    make("not_object", struct.pack("<Q", 2) + b"[]")
    make("not_utf8", struct.pack("<Q", 2) + b"\xff\xfe")
    for name, header, data in [
        (
            "offsets_past_end",
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 4,
        ),
        ("size_mismatch", {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
        ("reversed", {"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, b"\0" * 8),
        ("bad_shape", {"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
        ("bad_offsets", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, b"\0" * 8),
        ("no_dtype", {"a": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
        ("entry_not_object", {"a": 3}, b""),
        ("bad_metadata", {"__metadata__": 5, **good}, b"\0" * 8),
    ]:
        p = tmp / f"{name}.safetensors"
        _raw_file(p, header, data)
        files[name] = p
    return files


@pytest.mark.parametrize(
    "name",
    [
        "empty",
        "short_length",
        "length_past_end",
        "huge_length",
        "not_json",
        "not_object",
        "not_utf8",
        "offsets_past_end",
        "size_mismatch",
        "reversed",
        "bad_shape",
        "bad_offsets",
        "no_dtype",
        "entry_not_object",
        "bad_metadata",
    ],
)
def test_malformed_files_rejected_before_allocation(storage, tiers, name):
    files = _bad_files(tiers[0].path)
    good = tiers[0].path / "good.safetensors"
    save_file({"x": np.ones(4, np.float32)}, str(good))
    with pytest.raises(MalformedFile):
        storage.load_safetensors([good, files[name]])
    # Nothing was read: the good shard was not loaded either.
    assert storage.stats().operations_completed == 0


def test_unknown_dtype_in_header(storage, tiers):
    path = tiers[0].path / "x.safetensors"
    _raw_file(path, {"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(InvalidDtype):
        storage.load_safetensors(path)


def test_duplicate_tensor_across_shards(storage, tiers):
    for i in range(2):
        save_file({"same": np.ones(2, np.float32)}, str(tiers[0].path / f"{i}.safetensors"))
    with pytest.raises(InvalidInput):
        storage.load_safetensors([tiers[0].path / f"{i}.safetensors" for i in range(2)])


def test_unaligned_tensor_is_copied_to_an_aligned_array(storage, tiers, to_numpy):
    path = tiers[0].path / "odd.safetensors"
    f32 = np.arange(3, dtype=np.float32)
    _raw_file(
        path,
        {
            "b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            "f": {"dtype": "F32", "shape": [3], "data_offsets": [1, 13]},
        },
        b"\x07" + f32.tobytes(),
    )
    out = storage.load_safetensors(path)
    np.testing.assert_array_equal(to_numpy(out["f"]), f32)
    assert to_numpy(out["b"]).tolist() == [7]


def test_framework_mismatch(storage, tiers):
    path = tiers[0].path / "m.safetensors"
    save_file({"x": np.ones(4, np.float32)}, str(path))
    wrong = "numpy" if storage.device.is_cuda else "cupy"
    with pytest.raises(InvalidInput):
        storage.load_safetensors(path, framework=wrong)
