"""The remote I/O path (:mod:`tiering.io._remote`) on every device: a file opened from a
``Source`` whose bytes come only through its :class:`~tiering.ranges.RangeReader` (here a
reader of a local file by ``pread``, standing in for any source of remote bytes: the object
store itself is in tests/serving/test_object_loads.py), with staging pieces small enough that
every load crosses many of them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from tiering.config import TierConfig
from tiering.errors import InvalidInput
from tiering.io import GdsConfig, GdsFile, GpuDirectStorage
from tiering.io._remote import coalesce_rows
from tiering.ranges import RangeReader
from tiering.tiers import DirectoryTier, Source, Stat

KiB = 1 << 10
PIECE = 16 * KiB


class FileRanges(RangeReader):
    """A file's bytes by ranges: what io sees of an object or a peer, without the network."""

    def __init__(self, path: Path, pool: Executor) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self.fd).st_size
        super().__init__(path.name, size, "v1", pool=pool, part_size=PIECE // 4)

    def get(self, view: memoryview, offset: int) -> None:
        got = os.preadv(self.fd, [view], offset)
        if got != len(view):
            raise EOFError(f"{self.name}: {got} of {len(view)} bytes at {offset}")

    def close(self) -> None:
        os.close(self.fd)


class FileSource(Source):
    def __init__(self, path: Path, pool: Executor) -> None:
        self.relpath = path.name
        self._ranges = FileRanges(path, pool)
        self.stat = Stat(self._ranges.size, 0, "v1")

    @property
    def ranges(self) -> FileRanges:
        return self._ranges

    def readinto(self, buf: memoryview, offset: int) -> int:
        return self._ranges.readinto(buf, offset)

    def unchanged(self) -> bool:
        return True

    def close(self) -> None:
        self._ranges.close()


class Far:
    """Where the remote files are: ``root``, read through :class:`FileSource`."""

    name, rank = "far", 2

    def __init__(self, root: Path, pool: Executor) -> None:
        self.local_root, self.pool = root, pool

    def open(self, relpath: str) -> FileSource:
        return FileSource(self.local_root / relpath, self.pool)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[Far]:
    (tmp_path / "far").mkdir()
    with ThreadPoolExecutor(4) as pool:
        yield Far(tmp_path / "far", pool)


@pytest.fixture
def gds(target: tuple[str, str]) -> Iterator[GpuDirectStorage]:
    device, backend = target
    config = GdsConfig(
        backend=backend,  # type: ignore[arg-type]
        remote_piece_size=PIECE,
        remote_pieces=3,
        remote_threads=4,
        remote_stagings=1,
        prefetch_batch_size=8 * KiB,
    )
    with GpuDirectStorage(device, config) as s:
        yield s


def _open(gds: GpuDirectStorage, tier: Far, relpath: str) -> GdsFile:
    return gds.open_source(tier.open(relpath), tier=tier.name, rank=tier.rank)


def test_reads_of_every_size_cross_the_staging_pieces(
    gds: GpuDirectStorage, tier: Far, to_numpy: Any
) -> None:
    data = np.random.default_rng(0).integers(0, 256, 10 * PIECE + 123, dtype=np.uint8)
    (tier.local_root / "w.bin").write_bytes(data.tobytes())
    with _open(gds, tier, "w.bin") as f:
        assert (f.io_path, f.tier, f.size(), f.closed) == ("remote", "far", data.size, False)
        r = gds.read(f)
        assert (r.report.io_path, r.report.tier, r.report.nbytes) == ("remote", "far", data.size)
        assert np.array_equal(to_numpy(r.array), data)
        for off, n in [(0, 1), (PIECE - 1, 2), (3, 4 * PIECE + 5), (data.size - 7, 7), (9, 0)]:
            got = to_numpy(gds.read(f, off, n).array)
            assert np.array_equal(got, data[off : off + n]), (off, n)
        out = gds.device.empty(3 * PIECE)
        assert int(gds.load_to_gpu(f, 100, out)) == 3 * PIECE
        assert np.array_equal(to_numpy(out), data[100 : 100 + 3 * PIECE])
        rows = to_numpy(gds.read_vectors(f, 2, 5, 1, np.uint8).array)
        assert np.array_equal(rows, data[2:7].reshape(5, 1))
    assert f.closed
    stats = gds.stats()
    assert set(stats.by_path) == {"remote"} and set(stats.by_tier) == {"far"}
    assert stats.by_path["remote"].operations_completed == 8


def test_gathers_coalesce_rows_and_keep_request_order(
    gds: GpuDirectStorage, tier: Far, to_numpy: Any
) -> None:
    m = np.random.default_rng(1).standard_normal((1000, 24)).astype(np.float32)
    (tier.local_root / "m.f32").write_bytes(m.tobytes())
    idx = np.random.default_rng(2).integers(0, 1000, 700)  # more than one 8 KiB batch
    with _open(gds, tier, "m.f32") as f:
        r = gds.gather(f, idx, 24, np.float32)
        assert r.report.io_path == "remote" and r.array.shape == (700, 24)
        assert np.array_equal(to_numpy(r.array), m[idx])
        buf = gds.device.empty(3 * 24 * 4)
        gds.prefetch_vectors(f, [999, 0, 999], 24, np.float32, buf)
        assert to_numpy(buf).tobytes() == m[[999, 0, 999]].tobytes()
        assert gds.gather(f, [], 24, np.float32).array.shape == (0, 24)


def test_safetensors_from_a_remote_file(gds: GpuDirectStorage, tier: Far, to_numpy: Any) -> None:
    rng = np.random.default_rng(3)
    tensors = {f"t{i}": rng.standard_normal((30, 50)).astype(np.float32) for i in range(6)}
    save_file(tensors, str(tier.local_root / "s.safetensors"))
    with _open(gds, tier, "s.safetensors") as f:
        (shard,) = gds.load_safetensors_raw([f])
        (sub,) = gds.load_safetensors_raw([f], names=["t0", "t3", "t5"])
        assert not f.closed  # files passed in are left open
    for layout, names in ((shard, list(tensors)), (sub, ["t0", "t3", "t5"])):
        assert sorted(layout.tensors) == names and layout.report.io_path == "remote"
        buf = to_numpy(layout.buffer)
        for name in names:
            at, info = layout.tensors[name]
            assert buf[at : at + info.nbytes].tobytes() == tensors[name].tobytes(), name
    # The subset reads only its tensors: three separate ranges, no span between them.
    assert sub.report.nbytes == 3 * tensors["t0"].nbytes


def test_a_failed_range_fails_the_read_and_is_counted(gds: GpuDirectStorage, tier: Far) -> None:
    path = tier.local_root / "short.bin"
    path.write_bytes(b"s" * (4 * PIECE))
    with _open(gds, tier, "short.bin") as f:
        path.write_bytes(b"s" * PIECE)  # truncated in place after the open
        with pytest.raises(EOFError, match="short.bin"):
            gds.read(f)
        assert gds.read(f, 0, PIECE).report.nbytes == PIECE  # the file is still usable
    assert gds.stats().by_path["remote"].operations_failed == 1


def test_a_local_source_is_opened_with_open_file(tmp_path: Path) -> None:
    local = DirectoryTier(TierConfig("near", path=tmp_path / "near"), rank=0)
    local.check()
    (tmp_path / "near" / "l.bin").write_bytes(b"local")
    with GpuDirectStorage("cpu") as gds, local.open("l.bin") as src:
        assert src.ranges is None
        with pytest.raises(InvalidInput, match="open_file"):
            gds.open_source(src, tier=local.name, rank=local.rank)
    local.close()


def test_coalesced_ranges_cover_every_row_and_at_most_double_the_bytes() -> None:
    rng = np.random.default_rng(4)
    for _ in range(50):
        rows = np.unique(rng.integers(0, 100_000, rng.integers(1, 400)))
        row_bytes = int(rng.choice([4, 256, 4096]))
        first, end = coalesce_rows(rows, row_bytes, gap_bytes=64 * KiB)
        assert np.all(first[1:] > end[:-1])  # sorted, disjoint, not touching
        k = np.searchsorted(first, rows, side="right") - 1
        assert np.all((first[k] <= rows) & (rows < end[k]))
        assert int((end - first).sum()) <= 2 * rows.size
    # A 6-row gap is within gap_bytes but would read more than the 5 rows wanted: split.
    first, end = coalesce_rows(np.array([0, 1, 2, 9, 10]), 8, gap_bytes=64)
    assert (first.tolist(), end.tolist()) == ([0, 9], [3, 11])
    # A 3-row gap among 7 wanted rows is read through.
    first, end = coalesce_rows(np.array([0, 1, 2, 3, 4, 5, 9]), 8, gap_bytes=64)
    assert (first.tolist(), end.tolist()) == ([0], [10])
    # A gap over gap_bytes is never read through.
    first, end = coalesce_rows(np.arange(0, 40, 2) * 100, 8, gap_bytes=64)
    assert first.size == 20
