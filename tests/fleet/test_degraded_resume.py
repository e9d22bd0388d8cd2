"""PostgreSQL comes back while tierd runs: the moves an outage cut are settled without a restart
(and only those no live move holds), and this host's advisory lock, which the restart dropped, is
taken again, or, when another tierd with the same host id took it meanwhile, this one stops
writing and says so in ``/readyz``.

Each test runs its own PostgreSQL server (the session's shared one is never stopped)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.api.health import readyz
from tests.conftest import wait_for
from tests.helpers import engine_settings, put, tier_files
from tests.pg_support import PausablePg
from tiering.catalog import MigrationPhase
from tiering.engine import Engine
from tiering.errors import CatalogUnreachable, HostLockLost, Unavailable
from tiering.moves.recovery import settle

DATA = bytes(range(256)) * 40 + b"end"


@pytest.fixture
def url(private_pg: PausablePg) -> str:
    return private_pg.url(private_pg.create_database())


def _engine(root: Path, url: str) -> Engine:
    settings = engine_settings(
        root, host_id="host-a", catalog_url=url, watch=False, heartbeat_interval_s=3600
    )
    return Engine(settings.engine_config())


def _settle(eng: Engine) -> Any:
    m = eng.mover
    return settle(m.catalog, m.journal, m.tiers, m.guards)


@pytest.mark.parametrize(
    ("cut_at", "phase", "home"),
    [
        # Before the commit point the source is authoritative: the published copy goes.
        ("published", MigrationPhase.ABORTED, "hdd"),
        # After it the destination is: the intent is finished (the source was already gone).
        ("switched", MigrationPhase.DONE, "ssd"),
    ],
)
def test_a_move_cut_by_an_outage_is_settled_when_postgresql_returns(
    tmp_path: Path, private_pg: PausablePg, url: str, cut_at: str, phase: str, home: str
) -> None:
    with _engine(tmp_path / "data", url) as eng:
        rec = put(eng, "m/a.bin", DATA, tier="hdd")
        # Passes often, but no policy moves: only the scheduler's settling is under test.
        policy = eng.policy_info().policy.model_dump(mode="json")
        eng.set_policy(policy | {"enabled": False, "interval_s": 0.1})

        def cut(step: str) -> None:
            if step == cut_at:
                private_pg.halt()

        eng.mover.hook = cut
        with pytest.raises(Unavailable):
            eng.migrate(rec.id, "ssd")
        eng.mover.hook = None
        # The move could not record its end: the intent is open, the file migrating.
        wait_for(lambda: eng.scheduler.paused is not None, what="the scheduler's pause")
        private_pg.resume()

        def settled() -> bool:
            rows = eng.journal.list(file_id=rec.id, limit=10)
            return len(rows) == 1 and rows[0].phase == phase

        wait_for(settled, what="the cut move's intent settled without a restart")
        now = eng.catalog.get(rec.id)
        assert now.state == "stable" and now.tier == home
        assert tier_files(eng) == {"m/a.bin": [home]}  # one copy, no temp
        content = eng.open_content(rec.id)
        assert b"".join(content.iter_range(0, content.size)) == DATA
        assert eng.journal.own_open_intents() == []
        assert eng.scheduler.last_settle is not None and eng.scheduler.last_settle.changed
        assert eng.scheduler.paused is None
        # Settling again changes nothing.
        again = _settle(eng)
        assert not again.changed
        assert tier_files(eng) == {"m/a.bin": [home]}


def test_settling_leaves_a_live_move_alone(
    tmp_path: Path, private_pg: PausablePg, url: str
) -> None:
    with _engine(tmp_path / "data", url) as eng:
        rec = put(eng, "m/a.bin", DATA, tier="hdd")
        claim = eng.mover.claim(rec.id, "ssd", reason="manual")  # held, not yet running
        report = _settle(eng)
        assert not report.changed
        [open_] = eng.journal.own_open_intents()
        assert open_.id == claim.intent.id and eng.catalog.get(rec.id).state == "migrating"
        done = eng.mover.run(claim)  # the live move closes its own intent
        assert done.phase == MigrationPhase.DONE
        assert tier_files(eng) == {"m/a.bin": ["ssd"]}
        assert not _settle(eng).changed


def test_the_host_lock_is_taken_again_after_a_restart(
    tmp_path: Path, private_pg: PausablePg, url: str
) -> None:
    with _engine(tmp_path / "a", url) as eng:
        eng.scheduler.stop()  # the test makes every catalog call here
        rec = put(eng, "m/a.bin", DATA, tier="hdd")
        private_pg.halt()
        with pytest.raises(CatalogUnreachable):
            eng.pin(rec.id, "hdd")
        private_pg.resume()
        assert eng.pin(rec.id, "hdd").pinned_tier == "hdd"  # the first write takes it again
        assert eng.catalog.db.fenced is None
        # Held again: a second tierd with this host id is refused, as at any start.
        with pytest.raises(Unavailable, match="already serving"):
            _engine(tmp_path / "b", url).start()


def test_another_process_that_took_the_host_lock_fences_this_one(
    tmp_path: Path, private_pg: PausablePg, url: str
) -> None:
    with _engine(tmp_path / "a", url) as first:
        first.scheduler.stop()  # started again below, once the lock is lost
        rec = put(first, "m/a.bin", DATA, tier="hdd")
        private_pg.halt()
        with pytest.raises(CatalogUnreachable):
            first.pin(rec.id, "hdd")
        private_pg.resume()
        # PostgreSQL dropped the first's lock: a second tierd with the same host id starts.
        with _engine(tmp_path / "b", url) as second:
            second.scheduler.stop()
            with pytest.raises(HostLockLost, match="another tierd with host id 'host-a'"):
                first.pin(rec.id, "hdd")
            assert first.catalog.db.fenced is not None
            with pytest.raises(HostLockLost):
                put(first, "m/new.bin", b"x" * 10, tier="hdd")
            assert first.catalog.find("m/new.bin") is None  # nothing was written
            assert not (tmp_path / "a/hdd/m/new.bin").exists()
            assert first.catalog.get(rec.id).pinned_tier is None  # reads still answer
            r = readyz(first)
            body = json.loads(bytes(r.body))
            assert r.status_code == 503 and body["status"] == "not_ready"
            assert "took this host's lock" in body["checks"]["host_lock"]["error"]
            # Its scheduler stops moving for good, saying why.
            first.scheduler.start()
            wait_for(lambda: first.scheduler.paused is not None, what="the fenced pause")
            assert "another tierd" in (first.scheduler.paused or "")
            # The second serves this host now.
            assert second.pin(rec.id, "hdd").pinned_tier == "hdd"
            assert json.loads(bytes(readyz(second).body))["status"] == "ready"
