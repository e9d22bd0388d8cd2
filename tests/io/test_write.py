"""write_from_gpu: complete files or none, never a clobbered one, no temp files left."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tiering.errors import AlreadyExists, FileNotFound, InvalidPath
from tiering.io import TMP_SUFFIX


def _leftovers(directory):
    return [p.name for p in directory.iterdir() if p.name.endswith(TMP_SUFFIX)]


@pytest.mark.parametrize("size", [0, 1, 4097, (1 << 20) + 3])
def test_write_round_trip(storage, tiers, write_random, to_numpy, size):
    data = write_random(tiers[0].path / "src.bin", size)
    with storage.open_file(tiers[0].path / "src.bin") as f:
        arr = storage.read(f).array
    report = storage.write_from_gpu(arr, tiers[1].path / "copy.bin")
    assert report.nbytes == size and report.tier == "ssd"
    assert (tiers[1].path / "copy.bin").read_bytes() == data.tobytes()
    assert _leftovers(tiers[1].path) == []
    assert storage.stats().by_tier["ssd"].bytes_transferred == size


def test_typed_arrays_write_their_bytes(storage, tiers, to_numpy):
    a = np.arange(1000, dtype=np.float32).reshape(10, 100)
    buf = storage.device.xp.asarray(a)
    storage.write_from_gpu(buf, tiers[0].path / "a.f32")
    assert (tiers[0].path / "a.f32").read_bytes() == a.tobytes()


def test_no_clobber_and_overwrite(storage, tiers):
    target = tiers[0].path / "x.bin"
    target.write_bytes(b"old")
    with pytest.raises(AlreadyExists):
        storage.write_from_gpu(np.frombuffer(b"new!", np.uint8), target)
    assert target.read_bytes() == b"old"
    storage.write_from_gpu(np.frombuffer(b"new!", np.uint8), target, overwrite=True)
    assert target.read_bytes() == b"new!"
    assert _leftovers(tiers[0].path) == []


def test_missing_directory_and_bad_names(storage, tiers):
    with pytest.raises(FileNotFound):
        storage.write_from_gpu(np.zeros(4, np.uint8), tiers[0].path / "nope" / "x.bin")
    with pytest.raises(InvalidPath):
        storage.write_from_gpu(np.zeros(4, np.uint8), tiers[0].path / ("x" + TMP_SUFFIX))


def test_failed_fsync_leaves_nothing(storage, tiers, monkeypatch):
    def boom(fd):
        raise OSError(5, "injected EIO")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="injected"):
        storage.write_from_gpu(np.ones(10_000, np.uint8), tiers[0].path / "x.bin")
    assert list(tiers[0].path.iterdir()) == []
    assert storage.stats().operations_failed == 1


def test_link_race_is_caught(storage, tiers, monkeypatch):
    """Someone creates the target between the check and the publish: we do not clobber."""
    target = tiers[0].path / "x.bin"
    real_link = os.link

    def racing_link(src, dst, *a, **kw):
        target.write_bytes(b"theirs")
        return real_link(src, dst, *a, **kw)

    monkeypatch.setattr(os, "link", racing_link)
    with pytest.raises(AlreadyExists):
        storage.write_from_gpu(np.ones(10, np.uint8), target)
    assert target.read_bytes() == b"theirs"
    assert _leftovers(tiers[0].path) == []


def test_temp_name_pattern(tmp_path):
    from tiering.io._write import temp_name

    t = temp_name(tmp_path / ("n" * 255))
    assert t.parent == tmp_path and t.name.startswith(".n") and t.name.endswith(TMP_SUFFIX)
    assert len(t.name) <= 255
