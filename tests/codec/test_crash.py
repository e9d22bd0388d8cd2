"""kill -9 at every step of a move that compresses (RELIABILITY.md rows 1 and 28): recovery
leaves one verified copy, read back as the logical bytes, and runs twice as a no-op."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.conftest import disk_snapshot
from tests.helpers import assert_invariants, engine_settings, put
from tests.moves.test_faults import fail_nth
from tests.moves.test_recovery import crash_move
from tierd_bench.codec import synthetic_bf16
from tiering.codec import CODEC, MAGIC
from tiering.engine import Engine
from tiering.errors import InsufficientSpace, StorageError
from tiering.moves import STEPS
from tiering.tiers.paths import COMPRESSED_DIR

NAME = "m/model.safetensors"


@pytest.fixture(scope="module")
def bf16() -> bytes:
    return synthetic_bf16(3 << 20, tensors=2)


@pytest.mark.parametrize("step", STEPS)
def test_kill_9_at_every_step_of_a_compressing_move(tmp_path: Path, step: str, bf16: bytes) -> None:
    settings = engine_settings(tmp_path / "data", compression="on")
    with Engine(settings.engine_config()) as eng:
        fid = put(eng, NAME, bf16).id
    crash_move(settings, fid, "hdd", step)
    committed = STEPS.index(step) >= STEPS.index("switched")
    with Engine(settings.engine_config()) as eng:
        assert_invariants(eng, {NAME: bf16})
        assert eng.get(fid).tier == ("hdd" if committed else "nvme")
        if committed:
            assert (
                (settings.data_dir / "hdd" / COMPRESSED_DIR / NAME).read_bytes().startswith(MAGIC)
            )
        snap = disk_snapshot(settings.data_dir)
        assert not eng.mover.recover().changed
        assert disk_snapshot(settings.data_dir) == snap


def test_a_lost_source_is_replaced_by_the_verified_compressed_copy(
    tmp_path: Path, bf16: bytes
) -> None:
    """Killed after publish, before the switch, and the source then lost: recovery hashes the
    compressed copy's logical bytes, finds them right, and keeps it."""
    settings = engine_settings(tmp_path / "data", compression="on")
    with Engine(settings.engine_config()) as eng:
        fid = put(eng, NAME, bf16).id
    crash_move(settings, fid, "hdd", "published")
    (settings.data_dir / "nvme" / NAME).unlink()
    with Engine(settings.engine_config()) as eng:
        assert eng.last_recovery is not None and eng.last_recovery.relocated == [fid]
        assert_invariants(eng, {NAME: bf16})
        rec = eng.get(fid)
        stored = (settings.data_dir / "hdd" / COMPRESSED_DIR / NAME).stat().st_size
        assert (rec.tier, rec.codec, rec.stored_size) == ("hdd", CODEC, stored)


@pytest.mark.parametrize(
    ("call", "err", "raised"),
    [("write", errno.ENOSPC, InsufficientSpace), ("fsync", errno.EIO, StorageError)],
)
def test_a_failing_disk_aborts_a_compressing_move_cleanly(
    tmp_path: Path, bf16: bytes, monkeypatch: pytest.MonkeyPatch, call: str, err: int, raised: type
) -> None:
    """ENOSPC mid-container, EIO from the temp's fsync (RELIABILITY.md rows 3 and 4): the move
    fails with a clear error, nothing is left on hdd, and it works once the disk is sound."""
    settings = engine_settings(tmp_path / "data", compression="on")
    with Engine(settings.engine_config()) as eng:
        fid = put(eng, NAME, bf16).id
        (settings.data_dir / "hdd" / "m").mkdir(parents=True)  # the temp's is the 1st fsync
        monkeypatch.setattr(os, call, fail_nth(getattr(os, call), 5 if call == "write" else 1, err))
        with pytest.raises(raised):
            eng.migrate(fid, "hdd")
        monkeypatch.undo()
        assert eng.get(fid).tier == "nvme"
        assert_invariants(eng, {NAME: bf16})
        eng.migrate(fid, "hdd")
        assert_invariants(eng, {NAME: bf16})
        assert eng.get(fid).codec == CODEC
