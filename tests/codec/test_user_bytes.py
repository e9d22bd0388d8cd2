"""A user's file that begins with tierd's container magic is the user's bytes (RELIABILITY.md
row 29): where a file is says whether it is a container, never its first bytes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import assert_invariants, engine_settings, put
from tierd_bench.codec import synthetic_bf16
from tiering.codec import CODEC, MAGIC, encode_bytes
from tiering.engine import Engine
from tiering.tiers.paths import COMPRESSED_DIR

NAME = "user/looks-like-tierd.bin"


@pytest.fixture(scope="module")
def container() -> bytes:
    """A real container of tierd's: what a user gets by copying one out of a tier."""
    data = encode_bytes(synthetic_bf16(3 << 20, tensors=2))
    assert data.startswith(MAGIC)
    return data


def test_a_container_uploaded_as_user_bytes_reads_back_as_uploaded(
    tmp_path: Path, container: bytes
) -> None:
    settings = engine_settings(tmp_path / "data", compression="on")
    with Engine(settings.engine_config()) as eng:
        rec = put(eng, NAME, container)  # nvme: a tier that does not compress
        assert (rec.size, rec.codec) == (len(container), None)
        assert eng.tiers.get("nvme").read_bytes(NAME) == container
        # What the watcher does when it sees the file: nothing changed.
        report = eng.scan()
        assert NAME not in report.changed and NAME not in report.adopted
        assert eng.get(rec.id).size == len(container)
        # Onto the compressing tier (stored as a container of the user's container) and back.
        eng.migrate(rec.id, "hdd")
        hdd = settings.data_dir / "hdd"
        assert (hdd / COMPRESSED_DIR / NAME).exists() and not (hdd / NAME).exists()
        assert eng.get(rec.id).codec == CODEC
        assert eng.tiers.get("hdd").read_bytes(NAME) == container
        eng.migrate(rec.id, "nvme")
        assert eng.tiers.get("nvme").read_bytes(NAME) == container
        assert not eng.scan().changed
        assert_invariants(eng, {NAME: container})


def test_a_container_placed_in_a_tier_root_is_adopted_as_its_bytes(
    tmp_path: Path, container: bytes
) -> None:
    settings = engine_settings(tmp_path / "data", compression="on")
    with Engine(settings.engine_config()) as eng:
        for tier in ("nvme", "hdd"):  # a plain tier and a compressing one
            path = settings.data_dir / tier / tier / "copied.bin"
            path.parent.mkdir(parents=True)
            path.write_bytes(container)
        assert sorted(eng.scan().adopted) == ["hdd/copied.bin", "nvme/copied.bin"]
        for tier in ("nvme", "hdd"):
            rec = eng.catalog.lookup(f"{tier}/copied.bin")
            assert (rec.size, rec.codec) == (len(container), None)
            assert eng.tiers.get(tier).read_bytes(rec.relpath) == container
        assert not eng.scan().changed


def test_a_container_moved_out_of_its_place_by_hand_is_user_bytes(
    tmp_path: Path, container: bytes
) -> None:
    """The other way round: a compressed file of tierd's copied to a plain path by a person is
    what it is on disk (tierd reads containers only at its own place)."""
    settings = engine_settings(tmp_path / "data", compression="on")
    data = synthetic_bf16(3 << 20, tensors=2)
    with Engine(settings.engine_config()) as eng:
        rec = put(eng, "m/model.safetensors", data, tier="hdd")
        assert rec.codec == CODEC
        hdd = settings.data_dir / "hdd"
        shutil.copyfile(hdd / COMPRESSED_DIR / rec.relpath, hdd / "copy.bin")
        assert eng.scan().adopted == ["copy.bin"]
        copy = eng.catalog.lookup("copy.bin")
        stored = (hdd / "copy.bin").read_bytes()
        assert copy.size == len(stored) and eng.tiers.get("hdd").read_bytes("copy.bin") == stored
        assert eng.tiers.get("hdd").read_bytes(rec.relpath) == data


def test_containers_of_the_earlier_layout_are_moved_to_their_place_once(
    tmp_path: Path, container: bytes
) -> None:
    """An earlier tierd kept containers at the files' own paths: the first start of this one
    moves those its records name to ``.tierd-compressed``; a user's file is left alone."""
    settings = engine_settings(tmp_path / "data", compression="on")
    data = synthetic_bf16(3 << 20, tensors=2)
    hdd = settings.data_dir / "hdd"
    with Engine(settings.engine_config()) as eng:
        rec = put(eng, "m/model.safetensors", data, tier="hdd")
        (hdd / "u").mkdir()
        (hdd / "u/user.bin").write_bytes(container)  # a user's, that looks like tierd's
        assert eng.scan().adopted == ["u/user.bin"]
        assert rec.codec == CODEC and eng.catalog.lookup("u/user.bin").codec is None
    # The earlier layout: the container at the plain path, no .tierd-compressed directory.
    (hdd / "m").mkdir()
    (hdd / COMPRESSED_DIR / rec.relpath).rename(hdd / rec.relpath)
    shutil.rmtree(hdd / COMPRESSED_DIR)
    eng = Engine(settings.engine_config()).start(scheduler=False)
    try:
        assert (hdd / COMPRESSED_DIR / rec.relpath).exists() and not (hdd / rec.relpath).exists()
        assert eng.tiers.get("hdd").read_bytes(rec.relpath) == data
        assert eng.tiers.get("hdd").read_bytes("u/user.bin") == container
        assert not eng.last_scan.changed
        assert {r.state for r in eng.catalog.all()} == {"stable"}
    finally:
        eng.stop()
