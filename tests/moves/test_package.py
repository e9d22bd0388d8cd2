"""The package's public names, and the ``tiering.moves.mover`` names other modules import."""

from __future__ import annotations

import pytest

import tiering.moves
from tests.helpers import payload, put
from tiering.engine import Engine
from tiering.errors import InsufficientSpace
from tiering.moves import STEPS, mover, steps

PUBLIC = {
    "STEPS",
    "Cancelled",
    "Claim",
    "FileGuards",
    "Mover",
    "Progress",
    "RateLimiter",
    "RecoveryReport",
}


def test_public_names() -> None:
    assert not PUBLIC - set(tiering.moves.__all__)
    assert all(hasattr(tiering.moves, name) for name in tiering.moves.__all__)


def test_mover_module_names_match_the_package() -> None:
    # Tests, sibling modules and docs import these from ``tiering.moves.mover``.
    for name in mover.__all__:
        assert getattr(mover, name) is getattr(tiering.moves, name)
    assert mover.STEPS is steps.STEPS


def test_mover_knobs_reach_a_running_move(eng: Engine) -> None:
    # ``hook``, ``chunk_size`` and ``room`` are set on the Mover and read by the running move.
    rec = put(eng, "k.bin", payload(3 * 4096))
    seen: list[str] = []
    copies: list[int] = []
    eng.mover.hook = seen.append
    eng.mover.chunk_size = 4096
    eng.mover.migrate(rec.id, "ssd", progress=lambda done, size: copies.append(done))
    assert tuple(seen) == STEPS
    assert copies == [4096, 8192, 12288]
    eng.mover.room = lambda tier: 0
    with pytest.raises(InsufficientSpace, match="has room for 0"):
        eng.mover.migrate(rec.id, "hdd")
    eng.mover.hook = None
