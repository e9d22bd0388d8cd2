"""Two hosts on one PostgreSQL catalog: a move that host A's crash interrupted is A's to settle.

Host B starting (recovery, orphan cleanup, scan, watcher) leaves A's open intent, its record
and its temp as they were; A's restart settles it by the rule of RELIABILITY.md. Without the
intent's host, B's recovery would look for the move's sides on B's own tiers, find neither,
and quarantine A's file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.catalog.conftest import run_sql
from tests.helpers import engine_settings
from tests.moves.test_recovery import _prepare, _recover_and_check, crash_move
from tiering.catalog import FileState, MigrationPhase
from tiering.engine import Engine


@pytest.mark.parametrize("step", ["copied", "switched"])
def test_another_hosts_start_leaves_a_crashed_move_to_its_host(
    tmp_path: Path, pg_url: str, step: str
) -> None:
    a = engine_settings(tmp_path / "a", catalog_url=pg_url, host_id="host-a")
    b = engine_settings(tmp_path / "b", catalog_url=pg_url, host_id="host-b")
    files = _prepare(a)
    crash_move(a, 1, "hdd", step)
    [(intent_id, host, phase, temp)] = run_sql(
        pg_url,
        "SELECT id, host, phase, temp_name FROM migrations WHERE phase IN ('copying', 'switched')",
    )
    assert host == "host-a"
    temp_path = a.data_dir / "hdd" / "d" / temp
    had_temp = temp_path.exists()

    with Engine(b.engine_config()) as eng_b:
        assert eng_b.last_recovery is not None and not eng_b.last_recovery.changed
        rec = eng_b.catalog.lookup("d/f0.bin")
        # B's scan of its own (empty) tiers did not flag a file in flight as missing.
        assert rec.state == (FileState.STABLE if step == "switched" else FileState.MIGRATING)
        assert eng_b.journal.get(intent_id).phase == phase  # type: ignore[union-attr]
    assert temp_path.exists() == had_temp
    assert run_sql(pg_url, "SELECT phase FROM migrations WHERE id = :i", {"i": intent_id}) == [
        (phase,)
    ]

    committed = step == "switched"
    _recover_and_check(a, files, "hdd" if committed else "nvme")
    [(closed,)] = run_sql(pg_url, "SELECT phase FROM migrations WHERE id = :i", {"i": intent_id})
    assert closed == (MigrationPhase.DONE if committed else MigrationPhase.ABORTED)
