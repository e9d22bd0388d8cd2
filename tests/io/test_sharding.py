"""The sharding arithmetic (tiering.io.sharding): slices, uneven sizes, byte ranges, errors.

Byte ranges are checked against NumPy slicing of a real array's bytes, and uneven splits
against ``torch.chunk`` (torch for CPU is a test dependency).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.errors import InvalidInput, InvalidSharding
from tiering.io.sharding import (
    ShardingSpec,
    check_rank,
    check_spec,
    chunk_bounds,
    parse_sharding,
    slice_of,
)

shapes = st.lists(st.integers(1, 7), min_size=1, max_size=4).map(tuple)
FAST = settings(max_examples=150, deadline=None)


@st.composite
def cases(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int, np.dtype]:
    shape = draw(shapes)
    dim = draw(st.integers(0, len(shape) - 1))
    world = draw(st.integers(1, shape[dim]))
    dtype = np.dtype(draw(st.sampled_from(["uint8", "float16", "float32", "float64"])))
    return shape, dim, world, dtype


def _spec(world: int, dim: int) -> ShardingSpec:
    return parse_sharding({"world_size": world, "rules": [{"pattern": "w", "dim": dim}]})


@FAST
@given(st.integers(0, 200), st.integers(1, 40))
def test_chunks_tile_the_dimension_exactly(n: int, world: int) -> None:
    bounds = [chunk_bounds(n, world, k) for k in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (_a, b), (c, _d) in zip(bounds, bounds[1:], strict=False):
        assert b == c
    assert all(lo <= hi for lo, hi in bounds)


@FAST
@given(st.integers(1, 200), st.integers(1, 40))
def test_uneven_chunks_equal_torch_chunk(n: int, world: int) -> None:
    chunks = torch.arange(n).chunk(world)
    for k in range(world):
        lo, hi = chunk_bounds(n, world, k)
        if k < len(chunks):
            assert (lo, hi) == (int(chunks[k][0]), int(chunks[k][-1]) + 1)
        else:  # torch.chunk returns fewer chunks; the ranks beyond get nothing
            assert lo == hi == n


@FAST
@given(cases(), st.integers(0, 1000))
def test_byte_ranges_hold_exactly_the_slice(case, begin: int) -> None:  # type: ignore[no-untyped-def]
    shape, dim, world, dtype = case
    full = np.arange(math.prod(shape), dtype=np.int64).astype(dtype).reshape(shape)
    # A file: ``begin`` bytes of something else, then the tensor.
    data = bytes(range(256)) * (begin // 256 + 1)
    data = data[:begin] + full.tobytes()
    spec = _spec(world, dim)
    for rank in range(world):
        s = slice_of(spec, "w", shape, dtype.itemsize, rank)
        want = torch.from_numpy(full.astype(np.float64)).chunk(world, dim)
        expect = full[tuple(slice(o, o + n) for o, n in zip(s.offset, s.shape, strict=True))]
        if rank < len(want):
            assert np.array_equal(want[rank].numpy(), expect.astype(np.float64))
        got = b"".join(data[o : o + n] for o, n in s.byte_ranges(begin))
        assert got == np.ascontiguousarray(expect).tobytes()
        assert len(got) == s.nbytes
        at, n = s.whole_range(begin)
        whole = np.frombuffer(data[at : at + n], dtype=np.uint8)
        assert np.ascontiguousarray(s.cut_whole(whole)).tobytes() == got


@FAST
@given(cases())
def test_slices_of_every_rank_tile_the_tensor(case) -> None:  # type: ignore[no-untyped-def]
    shape, dim, world, dtype = case
    spec = _spec(world, dim)
    parts = [slice_of(spec, "w", shape, dtype.itemsize, k) for k in range(world)]
    assert sum(p.nbytes for p in parts) == math.prod(shape) * dtype.itemsize
    assert [p.offset[dim] for p in parts] == [p.start for p in parts]
    assert all(
        p.shape[:dim] == shape[:dim] and p.shape[dim + 1 :] == shape[dim + 1 :] for p in parts
    )


def test_dim_zero_is_one_range_and_unmatched_tensors_replicate() -> None:
    spec = parse_sharding(
        {
            "world_size": 2,
            "rules": [{"pattern": "*.q.weight", "dim": 0}, {"pattern": "*", "dim": 1}],
        }
    )
    s = slice_of(spec, "l0.q.weight", (6, 4), 2, 1)
    assert (s.dim, s.start, s.stop, s.shape, s.offset) == (0, 3, 6, (3, 4), (3, 0))
    assert s.byte_ranges(100) == [(100 + 3 * 8, 24)]
    # First match wins: "*" splits the rest on dim 1.
    assert slice_of(spec, "l0.k.weight", (6, 4), 2, 0).dim == 1
    plain = parse_sharding({"world_size": 2, "rules": [{"pattern": "*.q.weight", "dim": 0}]})
    r = slice_of(plain, "norm", (5,), 4, 1)
    assert (r.dim, r.shape, r.nbytes) == (None, (5,), 20)
    assert r.byte_ranges(8) == [(8, 20)]


def test_uneven_split_gives_an_empty_last_rank() -> None:
    spec = _spec(4, 0)
    sizes = [slice_of(spec, "w", (5, 3), 4, k).shape[0] for k in range(4)]
    assert sizes == [2, 2, 1, 0]
    assert slice_of(spec, "w", (5, 3), 4, 3).byte_ranges(0) == []


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"world_size": 0, "rules": []}, "world_size"),
        ({"world_size": -2, "rules": []}, "world_size"),
        ({"world_size": True, "rules": []}, "world_size"),
        ({"rules": []}, "world_size"),
        ({"world_size": 2, "rules": [{"pattern": "*", "dim": -1}]}, "dim"),
        ({"world_size": 2, "rules": [{"pattern": "", "dim": 0}]}, "pattern"),
        ({"world_size": 2, "rules": [{"pattern": "*"}]}, "pattern and dim"),
        ({"world_size": 2, "rules": "*"}, "list"),
        ({"world_size": 2, "strict": "yes"}, "strict"),
        ({"world_size": 2, "ranks": 3}, "unknown"),
        ([1, 2], "object"),
    ],
)
def test_bad_specs_are_refused_naming_the_problem(doc: object, words: str) -> None:
    with pytest.raises(InvalidSharding, match=words) as info:
        parse_sharding(doc)  # type: ignore[arg-type]
    assert isinstance(info.value, InvalidInput)  # so the service answers 422
    assert info.value.code == "invalid_sharding"


def test_spec_checked_against_the_tensors() -> None:
    tensors = {"a.weight": (4, 6), "b.bias": (4,)}
    check_spec(parse_sharding({"world_size": 4}), tensors)
    dim = parse_sharding({"world_size": 2, "rules": [{"pattern": "*.bias", "dim": 1}]})
    with pytest.raises(InvalidSharding, match=r"'b.bias' of shape \[4\] has no dimension 1"):
        check_spec(dim, tensors)
    wide = parse_sharding({"world_size": 5, "rules": [{"pattern": "a.*", "dim": 0}]})
    with pytest.raises(InvalidSharding, match="world_size 5 is larger than dimension 0"):
        check_spec(wide, tensors)
    loose = {"world_size": 2, "rules": [{"pattern": "nope.*", "dim": 0}]}
    check_spec(parse_sharding(loose), tensors)  # not strict: replicated
    with pytest.raises(InvalidSharding, match=r"match no tensor \(strict\): nope\.\*"):
        check_spec(parse_sharding({**loose, "strict": True}), tensors)
    for rank in (-1, 2, True):
        with pytest.raises(InvalidSharding, match="rank must be in"):
            check_rank(parse_sharding(loose), rank)
