"""Compressed files decoded on the GPU by nvCOMP: every chunk kind, ranges that cut chunks,
odd destinations, a damaged chunk; and the host decode where nvCOMP is absent or turned off.

The GPU tests need CUDA and nvCOMP (the GPU machine); the last test runs everywhere."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.io.conftest import cuda_ok
from tierd_bench.codec import synthetic_bf16
from tiering.codec import CHUNK, CorruptContainer, Kind, open_bytes
from tiering.config import TierConfig
from tiering.io import GdsConfig, GpuDirectStorage
from tiering.io._decode_gpu import available
from tiering.tiers import DirectoryTier
from tiering.tiers.paths import COMPRESSED_DIR

MiB = 1 << 20


def _needs_gpu_codec() -> None:
    if not cuda_ok():
        pytest.skip("needs CuPy and a CUDA device")
    why = available()
    if why is not None:
        pytest.skip(why)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[DirectoryTier]:
    t = DirectoryTier(TierConfig("slow", path=tmp_path / "slow", compression="on"), rank=0)
    t.check()
    yield t
    t.close()


def _mixed() -> bytes:
    """A safetensors file whose chunks take every kind: bf16 tensors (SPLIT2), then text-like
    bytes (ZSTD), then random bytes (RAW), the last chunk short."""
    bf16 = synthetic_bf16(3 * CHUNK, tensors=3)
    rng = np.random.default_rng(7)
    words = np.array([b"weight ", b"bias ", b"layer ", b"norm "], dtype=object)
    text = b"".join(rng.choice(words, CHUNK // 4)).ljust(CHUNK, b".")[:CHUNK]
    noise = rng.integers(0, 256, CHUNK + 12345, dtype=np.uint8).tobytes()
    return bf16 + text + noise


def _store(tier: DirectoryTier, relpath: str, data: bytes) -> None:
    with tier.writer(relpath) as w:
        for i in range(0, len(data), 3 * MiB):
            w.write(data[i : i + 3 * MiB])
        w.publish()


def _host(arr: Any) -> bytes:
    if hasattr(arr, "__cuda_array_interface__"):
        return bytes(importlib.import_module("cupy").asnumpy(arr).tobytes())
    return bytes(np.asarray(arr).tobytes())


@pytest.fixture(scope="module")
def mixed() -> bytes:
    return _mixed()


def test_the_fixture_has_every_chunk_kind(tier: DirectoryTier, mixed: bytes) -> None:
    _store(tier, "m.safetensors", mixed)
    kinds = {
        e.kind
        for e in open_bytes((tier.root / COMPRESSED_DIR / "m.safetensors").read_bytes()).index
    }
    assert kinds == {Kind.SPLIT2, Kind.ZSTD, Kind.RAW}


@pytest.mark.gpu
def test_whole_files_and_ranges_decode_on_the_gpu(tier: DirectoryTier, mixed: bytes) -> None:
    _needs_gpu_codec()
    _store(tier, "m.safetensors", mixed)
    with (
        GpuDirectStorage("cuda:0") as gds,
        gds.open_source(tier.open("m.safetensors"), tier="slow", rank=0) as f,
    ):
        r = gds.read(f)
        assert r.report.engine == "nvcomp"
        assert _host(r.array) == mixed
        # Ranges that start and end inside chunks, odd offsets (the unaligned interleave),
        # one byte, and a range across every kind.
        for off, n in [
            (1, 2),
            (CHUNK - 3, 7),
            (CHUNK + 1, CHUNK),
            (3 * CHUNK - 5, 2 * CHUNK + 10),
            (len(mixed) - 1, 1),
            (17, len(mixed) - 40),
        ]:
            got = gds.read(f, off, n)
            assert got.report.engine == "nvcomp"
            assert _host(got.array) == mixed[off : off + n], (off, n)


@pytest.mark.gpu
def test_a_safetensors_load_decodes_on_the_gpu(tier: DirectoryTier) -> None:
    _needs_gpu_codec()
    data = synthetic_bf16(2 * CHUNK + 3 * MiB, tensors=5)
    _store(tier, "w.safetensors", data)
    with (
        GpuDirectStorage("cuda:0") as gds,
        gds.open_source(tier.open("w.safetensors"), tier="slow", rank=0) as f,
    ):
        (shard,) = gds.load_safetensors_raw([f])
        assert shard.report.engine == "nvcomp"
        got = _host(shard.buffer)
        assert len(shard.tensors) == 5
        for name, (at, info) in shard.tensors.items():
            assert got[at : at + info.nbytes] == data[info.begin : info.end], name


@pytest.mark.gpu
def test_a_damaged_chunk_is_an_error_never_bytes(tier: DirectoryTier, mixed: bytes) -> None:
    _needs_gpu_codec()
    _store(tier, "m.safetensors", mixed)
    path = tier.root / COMPRESSED_DIR / "m.safetensors"
    disk = bytearray(path.read_bytes())
    e = open_bytes(bytes(disk)).index[1]
    disk[e.offset + e.length // 2] ^= 0x10
    path.write_bytes(bytes(disk))
    with (
        GpuDirectStorage("cuda:0") as gds,
        gds.open_source(tier.open("m.safetensors"), tier="slow", rank=0) as f,
    ):
        assert _host(gds.read(f, 0, 100).array) == mixed[:100]  # chunk 0 is sound
        with pytest.raises(CorruptContainer, match=r"m\.safetensors: chunk 1"):
            gds.read(f, CHUNK + 1, 100)


@pytest.mark.gpu
def test_gpu_decode_off_decodes_on_the_host(tier: DirectoryTier, mixed: bytes) -> None:
    if not cuda_ok():
        pytest.skip("needs CuPy and a CUDA device")
    _store(tier, "m.safetensors", mixed)
    with (
        GpuDirectStorage("cuda:0", GdsConfig(gpu_decode=False)) as gds,
        gds.open_source(tier.open("m.safetensors"), tier="slow", rank=0) as f,
    ):
        r = gds.read(f)
        assert r.report.engine != "nvcomp" and _host(r.array) == mixed
