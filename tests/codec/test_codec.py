"""tierd's compressed format: lossless round trips, ranges, gathers, corruption, the ratio."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierd_bench.codec import synthetic_bf16
from tiering.codec import (
    CHUNK,
    FOOTER,
    HEADER,
    MAGIC,
    MIN_SIZE,
    Container,
    CorruptContainer,
    Encoder,
    Kind,
    encode_bytes,
    is_container,
    open_bytes,
    two_byte_spans,
)

MiB = 1 << 20


@pytest.fixture(scope="module")
def bf16() -> bytes:
    """A bf16 checkpoint over three chunks, ending inside the last."""
    return synthetic_bf16(2 * CHUNK + 3 * MiB + 2, tensors=3)


@pytest.fixture(scope="module")
def stored(bf16: bytes) -> bytes:
    return encode_bytes(bf16)


def _mixed(size: int) -> bytes:
    """A safetensors file of bf16, f32 and fp16 tensors, some at odd sizes."""
    rng = np.random.default_rng(7)
    parts: list[tuple[str, str, bytes]] = [
        ("a", "BF16", (rng.standard_normal(size // 8) * 0.02).astype(np.float16).tobytes()),
        ("b", "F32", (rng.standard_normal(size // 16) * 0.02).astype(np.float32).tobytes()),
        ("c", "F16", (rng.standard_normal(size // 4 + 1) * 0.02).astype(np.float16).tobytes()),
        ("d", "U8", bytes(rng.integers(0, 4, 333, dtype=np.uint8))),
    ]
    header: dict[str, object] = {}
    at = 0
    for name, dtype, blob in parts:
        item = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1}[dtype]
        header[name] = {
            "dtype": dtype,
            "shape": [len(blob) // item],
            "data_offsets": [at, at + len(blob)],
        }
        at += len(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(p[2] for p in parts)


def test_bf16_checkpoint_stores_at_most_072_of_its_size(bf16: bytes, stored: bytes) -> None:
    assert stored.startswith(MAGIC)
    assert len(stored) <= 0.72 * len(bf16)
    c = open_bytes(stored)
    assert c.size == len(bf16)
    assert {e.kind for e in c.index} >= {Kind.SPLIT2}
    assert c.read(0, c.size) == bf16


def test_spans_come_from_the_safetensors_header(bf16: bytes) -> None:
    n = int.from_bytes(bf16[:8], "little")
    assert two_byte_spans(bf16) == [(8 + n, len(bf16))]
    assert two_byte_spans(b"not safetensors at all") == []
    assert two_byte_spans(struct.pack("<Q", 10**12) + b"{}") == []


@pytest.mark.parametrize(
    ("offset", "length"),
    [
        (0, 1),
        (0, 8),
        (5, 1000),
        (CHUNK - 3, 7),  # across a chunk boundary
        (CHUNK, CHUNK),  # exactly one chunk
        (CHUNK - 1, CHUNK + 2),  # three chunks
        (2 * CHUNK + 1, 10 * MiB),  # past the end: cut short
        (1, 3 * CHUNK),
    ],
)
def test_ranges_inside_and_across_chunks(
    bf16: bytes, stored: bytes, offset: int, length: int
) -> None:
    c = open_bytes(stored)
    assert c.read(offset, length) == bf16[offset : offset + length]
    buf = bytearray(length)
    n = c.readinto(memoryview(buf), offset)
    assert bytes(buf[:n]) == bf16[offset : offset + length]


def test_gather_decodes_each_touched_chunk_once(bf16: bytes, stored: bytes) -> None:
    reads: list[int] = []

    def read(n: int, off: int) -> bytes:
        reads.append(off)
        return stored[off : off + n]

    c = Container.open("ckpt", read, len(stored))
    ranges = [(10, 20), (CHUNK + 5, 100), (CHUNK - 2, 4), (3, 2), (len(bf16) - 1, 5)]
    reads.clear()
    got = c.gather(ranges)
    assert got == [bf16[o : o + n] for o, n in ranges]
    assert sorted(reads) == sorted({c.index[i].offset for i in (0, 1, 2)})


@settings(max_examples=25, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=3000),
    repeat=st.integers(1, 3000),
    ranges=st.lists(st.tuples(st.integers(0, 5_000_000), st.integers(0, 3_000_000)), max_size=4),
)
def test_round_trip_of_any_bytes(data: bytes, repeat: int, ranges: list[tuple[int, int]]) -> None:
    """Whatever the bytes (compressible or not, tiny or over a chunk), the stored form decodes
    to them: a container, or the bytes themselves when they gain too little."""
    logical = (data * repeat)[: 3 * CHUNK]
    out = encode_bytes(logical)
    if not is_container(out[:HEADER], len(out)):
        assert out == logical
        return
    assert len(logical) >= MIN_SIZE or logical.startswith(MAGIC)
    c = open_bytes(out)
    assert c.read(0, c.size) == logical
    assert c.gather(ranges) == [logical[o : o + n] for o, n in ranges]


def test_a_file_that_starts_like_a_container_is_always_wrapped() -> None:
    """Else it would be stored as it is, and read back as a (damaged) container."""
    for logical in (MAGIC, MAGIC + bytes(100), MAGIC * 200_000):
        out = encode_bytes(logical)
        assert out != logical
        assert open_bytes(out).read(0, len(logical)) == logical


def test_mixed_dtypes_round_trip_and_kinds() -> None:
    data = _mixed(3 * CHUNK)
    out = encode_bytes(data)
    c = open_bytes(out)
    assert c.read(0, c.size) == data
    assert len(c.index) == 4
    assert Kind.SPLIT2 in {e.kind for e in c.index}
    assert len(out) < len(data)


def test_incompressible_and_small_files_are_kept_as_they_are() -> None:
    noise = np.random.default_rng(1).integers(0, 256, 2 * CHUNK, dtype=np.uint8).tobytes()
    assert encode_bytes(noise) == noise
    small = b"\0" * (MIN_SIZE - 1)
    assert encode_bytes(small) == small


def test_streaming_writes_of_any_size_make_the_same_container(bf16: bytes, stored: bytes) -> None:
    out: list[bytes] = []
    enc = Encoder(lambda b: out.append(bytes(b)))
    step = 777_777
    for i in range(0, len(bf16), step):
        enc.write(bf16[i : i + step])
    enc.finish()
    assert enc.compressed and enc.logical == len(bf16) and enc.stored == len(stored)
    assert b"".join(out) == stored


def test_a_corrupt_chunk_is_an_error_naming_the_file_and_chunk(bf16: bytes, stored: bytes) -> None:
    c = open_bytes(stored)
    e = c.index[1]
    for at in (e.offset + 2, e.offset + e.length // 2, e.offset + e.length - 1):
        bad = bytearray(stored)
        bad[at] ^= 0x40
        broken = open_bytes(bytes(bad), "models/ckpt.safetensors")
        assert broken.read(0, 100) == bf16[:100]  # other chunks still read
        with pytest.raises(CorruptContainer, match=r"models/ckpt\.safetensors: chunk 1") as ei:
            broken.read(CHUNK + 10, 10)
        assert ei.value.details == {"path": "models/ckpt.safetensors", "chunk": 1}
        with pytest.raises(CorruptContainer, match="chunk 1"):  # decoded whole, in place
            broken.readinto(memoryview(bytearray(2 * CHUNK)), 0)
        with pytest.raises(CorruptContainer, match="chunk 1"):
            broken.gather([(0, 5), (2 * CHUNK - 1, 1)])


@pytest.mark.parametrize("where", ["footer", "index", "truncated"])
def test_a_damaged_footer_or_index_is_refused(stored: bytes, where: str) -> None:
    bad = bytearray(stored)
    if where == "footer":
        bad[-FOOTER + 20] ^= 1
    elif where == "index":
        bad[-FOOTER - 3] ^= 1
    else:
        bad = bad[:-1]
    with pytest.raises(CorruptContainer, match="ckpt"):
        open_bytes(bytes(bad), "ckpt")
