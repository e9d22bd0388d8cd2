"""The move protocol's claim, switch and recovery on a PostgreSQL catalog: the mover tests
that exercise the compare-and-set, and kill -9 at every step of a move followed by recovery
(RELIABILITY.md rows 1, 8 and 10). Their SQLite runs are in tests/moves."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import engine_settings
from tests.moves.test_mover import (  # noqa: F401 (collected here, on PostgreSQL)
    test_delete_pin_and_second_move_during_a_move_are_refused,
    test_manual_move_errors_change_nothing,
    test_move_down_and_up_keeps_bytes_and_metadata,
    test_readers_during_back_and_forth_moves,
)
from tests.moves.test_recovery import _prepare, _recover_and_check, crash_move
from tiering.moves import STEPS

pytestmark = pytest.mark.parametrize("catalog_backend", ["postgresql"])


@pytest.mark.parametrize("step", STEPS)
def test_kill_9_at_every_step(tmp_path: Path, step: str, catalog_overrides: dict[str, str]) -> None:
    settings = engine_settings(tmp_path / "data", **catalog_overrides)
    assert settings.catalog_url.startswith("postgresql+psycopg://")
    files = _prepare(settings)
    crash_move(settings, 1, "hdd", step)
    committed = STEPS.index(step) >= STEPS.index("switched")
    _recover_and_check(settings, files, "hdd" if committed else "nvme")
