"""A compressing directory tier: files stored compressed, read as their logical bytes by
every path, verified by decoding before they are published; moves compress and decompress."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import assert_invariants, checksum, engine_settings, put
from tierd_bench.codec import synthetic_bf16
from tiering.codec import CHUNK, CODEC, MAGIC, CorruptContainer, open_bytes
from tiering.config import TierConfig
from tiering.engine import Engine
from tiering.errors import AlreadyExists, IntegrityError
from tiering.tiers import DirectoryTier
from tiering.tiers.paths import COMPRESSED_DIR

MiB = 1 << 20


@pytest.fixture(scope="module")
def bf16() -> bytes:
    return synthetic_bf16(2 * CHUNK + 5 * MiB, tensors=5)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[DirectoryTier]:
    t = DirectoryTier(TierConfig("slow", path=tmp_path / "slow", compression="on"), rank=0)
    t.check()
    yield t
    t.close()


def _write(tier: DirectoryTier, relpath: str, data: bytes, **kw: object) -> None:
    with tier.writer(relpath, **kw) as w:  # type: ignore[arg-type]
        for i in range(0, len(data), 3 * MiB):
            w.write(data[i : i + 3 * MiB])
        pub = w.publish()
    assert (pub.size, pub.stat.size, pub.checksum) == (len(data), len(data), checksum(data))


def test_stored_compressed_and_read_as_the_logical_file(tier: DirectoryTier, bf16: bytes) -> None:
    _write(tier, "m/model.safetensors", bf16)
    disk = (tier.root / COMPRESSED_DIR / "m/model.safetensors").read_bytes()
    assert disk.startswith(MAGIC) and len(disk) <= 0.72 * len(bf16)
    st = tier.stat("m/model.safetensors")
    assert st is not None and st.size == len(bf16)
    # The walk opens no file: a container's entry is its stored size, and says it is one.
    walked = [(e.relpath, e.size, e.codec) for e in tier.walk()]
    assert walked == [("m/model.safetensors", len(disk), CODEC)]
    with tier.open("m/model.safetensors") as src:
        assert src.size == len(bf16) and src.local_file() is None and src.unchanged()
        ranges = src.ranges
        assert ranges is not None and ranges.size == len(bf16)
        for off, n in [(0, 10), (CHUNK - 5, 10), (3, 2 * CHUNK + 7), (len(bf16) - 3, 3)]:
            buf = bytearray(n)
            assert ranges.readinto(memoryview(buf), off) == n
            assert bytes(buf) == bf16[off : off + n]
        assert b"".join(bytes(c) for c in src.chunks(5 * MiB)) == bf16
    probed = tier.probe("m/model.safetensors")
    assert probed is not None and probed[0] == checksum(bf16)


def test_a_closed_source_reads_nothing(tier: DirectoryTier, bf16: bytes) -> None:
    """A read after close fails; it never reads whatever file took the descriptor's number."""
    _write(tier, "m/model.safetensors", bf16)
    src = tier.open("m/model.safetensors")
    ranges = src.ranges
    assert ranges is not None
    src.close()
    # The next open may take the number the source's descriptor had.
    with open(tier.root / COMPRESSED_DIR / "m/model.safetensors", "rb"), pytest.raises(OSError):
        ranges.readinto(memoryview(bytearray(CHUNK + 1)), 0)


def test_an_overwrite_that_changes_the_form_leaves_one_copy(
    tier: DirectoryTier, bf16: bytes
) -> None:
    """Plain and compressed forms live at two places: an overwrite publishes the new form and
    removes the old; without ``overwrite`` either form refuses; where a crash left both, the
    newer is the file (walk, open and stat agree)."""
    noise = os.urandom(3 * MiB)
    plain, packed = tier.root / "f.bin", tier.root / COMPRESSED_DIR / "f.bin"
    _write(tier, "f.bin", noise)
    with pytest.raises(AlreadyExists):
        tier.writer("f.bin")
    _write(tier, "f.bin", bf16, overwrite=True)
    assert packed.exists() and not plain.exists()
    with pytest.raises(AlreadyExists):
        tier.writer("f.bin")
    _write(tier, "f.bin", noise, overwrite=True)
    assert plain.exists() and not packed.exists()
    assert tier.read_bytes("f.bin") == noise
    # Both forms (a crash between the publish and the removal): the newer one is the file.
    stale = plain.read_bytes()
    _write(tier, "f.bin", bf16, overwrite=True)
    plain.write_bytes(stale)
    os.utime(plain, ns=(1, 1))
    assert tier.read_bytes("f.bin") == bf16
    assert [(e.relpath, e.codec) for e in tier.walk()] == [("f.bin", CODEC)]
    st = tier.stat("f.bin")
    assert st is not None and st.size == len(bf16)
    assert tier.remove("f.bin") and not plain.exists() and not packed.exists()


def test_files_that_do_not_pay_are_stored_as_they_are(tier: DirectoryTier) -> None:
    noise = os.urandom(3 * MiB)
    _write(tier, "noise.bin", noise)
    assert (tier.root / "noise.bin").read_bytes() == noise
    with tier.open("noise.bin") as src:
        assert src.local_file() is not None


def test_a_corrupt_chunk_on_disk_is_an_error_naming_the_file(
    tier: DirectoryTier, bf16: bytes
) -> None:
    _write(tier, "m/model.safetensors", bf16)
    path = tier.root / COMPRESSED_DIR / "m/model.safetensors"
    disk = bytearray(path.read_bytes())
    e = open_bytes(bytes(disk)).index[1]
    disk[e.offset + e.length // 2] ^= 0x10
    path.write_bytes(bytes(disk))
    with tier.open("m/model.safetensors") as src:
        assert src.readinto(memoryview(bytearray(100)), 0) == 100  # chunk 0 is sound
        with pytest.raises(CorruptContainer, match=r"m/model\.safetensors: chunk 1"):
            src.readinto(memoryview(bytearray(100)), CHUNK + 1)


def test_a_copy_that_does_not_decode_is_never_published(
    tier: DirectoryTier, bf16: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte flipped on its way to disk (after the encoder, as a bad disk or driver would) is
    caught by the decode before publish: nothing at the final name, no temp left."""
    real_write = os.write
    seen = [0]

    def flaky(fd: int, data: bytes | memoryview) -> int:
        seen[0] += len(data) > 4096
        if seen[0] == 2 and len(data) > 4096:  # inside the container's chunks
            bad = bytearray(data)
            bad[len(bad) // 2] ^= 1
            return real_write(fd, bytes(bad))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", flaky)
    with pytest.raises(IntegrityError, match="does not decode"):
        _write(tier, "m/model.safetensors", bf16)
    monkeypatch.undo()
    assert tier.stat("m/model.safetensors") is None
    assert list(tier.temps()) == []


def test_a_wrong_expected_checksum_publishes_nothing(tier: DirectoryTier, bf16: bytes) -> None:
    with pytest.raises(IntegrityError):
        _write(tier, "m/model.safetensors", bf16, checksum=checksum(b"other"))
    assert tier.stat("m/model.safetensors") is None
    assert list(tier.temps()) == []


@pytest.mark.parametrize(
    ("mode", "rank", "compresses"),
    [("auto", 0, False), ("auto", 1, False), ("auto", 2, True), ("on", 0, True), ("off", 3, False)],
)
def test_auto_compresses_the_slow_tiers(
    tmp_path: Path, mode: str, rank: int, compresses: bool
) -> None:
    t = DirectoryTier(TierConfig("t", path=tmp_path, compression=mode), rank=rank)
    assert t.compresses is compresses
    assert t.copies().compresses is False  # host copies are filled by pieces


@pytest.fixture
def ceng(tmp_path: Path) -> Iterator[Engine]:
    """An engine of the default layout, compression as shipped: on for hdd (rank 2) only."""
    with Engine(engine_settings(tmp_path / "data", compression="auto").engine_config()) as e:
        yield e


def test_moves_compress_down_and_decompress_up(ceng: Engine, bf16: bytes) -> None:
    eng = ceng
    rec = put(eng, "models/m.safetensors", bf16)
    hdd, nvme = eng.tiers.get("hdd"), eng.tiers.get("nvme")
    assert (nvme.watch_root() / "models/m.safetensors").stat().st_size == len(bf16)  # type: ignore[operator]
    eng.migrate(rec.id, "hdd")
    stored = (hdd.watch_root() / COMPRESSED_DIR / "models/m.safetensors").read_bytes()  # type: ignore[operator]
    assert stored.startswith(MAGIC) and len(stored) <= 0.72 * len(bf16)
    moved = eng.get(rec.id)
    assert (moved.codec, moved.stored_size, moved.size) == (CODEC, len(stored), len(bf16))
    assert_invariants(eng, {"models/m.safetensors": bf16})
    report = eng.scan(check=True)
    assert report.drift == 0 and not report.conflicts
    eng.migrate(rec.id, "nvme")
    assert (eng.get(rec.id).codec, eng.get(rec.id).stored_size) == (None, None)
    assert (nvme.watch_root() / "models/m.safetensors").read_bytes() == bf16  # type: ignore[operator]
    assert_invariants(eng, {"models/m.safetensors": bf16})
