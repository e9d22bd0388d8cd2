"""RELIABILITY.md row 13: random sequences of uploads, reads, policy changes, migrations,
deletes, kill -9 crashes mid-move and restarts; after every step the invariants are checked
against the bytes on disk."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.helpers import assert_invariants, engine_settings, put
from tests.moves.test_recovery import crash_move
from tiering.engine import Engine
from tiering.errors import Conflict, FileBusy, InsufficientSpace
from tiering.moves import STEPS

TIERS = ["nvme", "ssd", "hdd"]
NAMES = [f"d{i % 2}/f{i}" for i in range(6)]


class Tiering(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tierd-sm-"))
        self.settings = engine_settings(self.root / "data")
        self.model: dict[str, bytes] = {}
        self.engine = self._start()

    def _start(self) -> Engine:
        eng = Engine(self.settings.engine_config()).start(scheduler=False)
        eng.mover.chunk_size = 16 << 10
        # Files of 40 kB and more (about half) are copied by the copy process (issue 43).
        eng.mover.settings.process_min = 40_000
        eng.mover.settings.process_chunk = 16 << 10
        return eng

    def teardown(self) -> None:
        self.engine.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def _id(self, name: str) -> int:
        return self.engine.lookup(name).id

    @rule(name=st.sampled_from(NAMES), size=st.integers(0, 80_000), tier=st.sampled_from(TIERS))
    def upload(self, name: str, size: int, tier: str) -> None:
        if name in self.model:
            return
        data = os.urandom(size)
        try:
            put(self.engine, name, data, tier=tier)
        except InsufficientSpace:
            return  # a quota from set_policy refused it cleanly; the invariants check the rest
        self.model[name] = data

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        content = self.engine.open_content(self._id(name))
        assert b"".join(content.iter_range(0, content.size)) == self.model[name]
        assert self.engine.access is not None
        self.engine.access.flush()

    @rule(
        nvme=st.sampled_from([0.5, 2.0, 100.0]),
        hysteresis=st.sampled_from([0.0, 0.2]),
        quota=st.sampled_from([None, 50_000, 200_000]),
    )
    def set_policy(self, nvme: float, hysteresis: float, quota: int | None) -> None:
        self.engine.set_policy(
            {
                "tiers": {
                    "nvme": {"min_heat": nvme, "quota_bytes": quota},
                    "ssd": {"min_heat": nvme / 4},
                    "hdd": {"min_heat": 0},
                },
                "hysteresis": hysteresis,
                "min_age_s": 0,
                "half_life_s": 5.0,
            }
        )

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=st.sampled_from(TIERS))
    def migrate(self, data: st.DataObject, tier: str) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        with contextlib.suppress(Conflict, FileBusy, InsufficientSpace):
            self.engine.migrate(self._id(name), tier)

    @rule()
    def run_plan(self) -> None:
        report = self.engine.run_plan()
        for claim in report.claimed:
            assert claim.done.is_set()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def pin_or_unpin(self, data: st.DataObject) -> None:
        fid = self._id(data.draw(st.sampled_from(sorted(self.model))))
        tier = data.draw(st.sampled_from([None, *TIERS]))
        if tier is None:
            self.engine.unpin(fid)
        else:
            self.engine.pin(fid, tier)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        self.engine.delete(self._id(name))
        del self.model[name]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=st.sampled_from(TIERS), step=st.sampled_from(STEPS))
    def crash_during_a_move(self, data: st.DataObject, tier: str, step: str) -> None:
        name = data.draw(st.sampled_from(sorted(self.model)))
        rec = self.engine.lookup(name)
        if rec.tier == tier or (rec.pinned_tier not in (None, tier)):
            return
        if rec.size > self.engine.mover.room(self.engine.tiers.get(tier)):
            return  # refused at step 2 (quota), so the child would never reach a later step
        self.engine.stop()
        crash_move(self.settings, rec.id, tier, step)
        self.engine = self._start()  # recovery runs here

    @rule()
    def restart(self) -> None:
        self.engine.stop()
        self.engine = self._start()
        assert self.engine.last_recovery is not None and not self.engine.last_recovery.changed

    @invariant()
    def consistent(self) -> None:
        assert_invariants(self.engine, self.model)
        assert {r.relpath for r in self.engine.catalog.all()} == set(self.model)


TestTiering = Tiering.TestCase
TestTiering.settings = settings(
    max_examples=6,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.slow
def test_state_machine_long() -> None:
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        Tiering,
        settings=settings(
            max_examples=60,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
