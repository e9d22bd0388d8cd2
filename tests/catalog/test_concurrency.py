"""The catalog's concurrency rules with many writers: the move claim's compare-and-set, the
switch as the commit point, deletes that never take a file from its mover, retries of writes
that lost a deadlock or an insert race, and heat decayed alike in SQL and in Python.

On SQLite the writers are threads of one process (its one writer serialises them); on
PostgreSQL they are also other hosts: a second :class:`Database` on the same catalog, or a
second engine with its own host id.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from tests.catalog.conftest import run_sql
from tests.conftest import wait_for
from tests.helpers import assert_invariants, engine_settings, payload, put
from tiering.catalog import Catalog, Database, FileRecord, MigrationPhase, NewFile, decay
from tiering.catalog.backends import FOR_WRITE
from tiering.catalog.journal import Journal
from tiering.engine import Engine
from tiering.errors import CatalogBusy, Conflict, FileBusy, Unavailable

postgresql_only = pytest.mark.parametrize("catalog_backend", ["postgresql"])


@pytest.fixture
def databases(eng: Engine) -> Iterator[list[Database]]:
    """The engine's database, and on PostgreSQL two more (other hosts' connections)."""
    url = eng.config.catalog_url
    extra = [] if eng.catalog.db.single_writer else [Database(url) for _ in range(2)]
    yield [eng.catalog.db, *extra]
    for db in extra:
        db.dispose()


def _threads(n: int, target: Callable[[int], None], name: str) -> list[threading.Thread]:
    return [threading.Thread(target=target, args=(i,), name=f"{name}-{i}") for i in range(n)]


def _claim_race(journals: list[Journal], file_id: int, n: int) -> tuple[list[int], int]:
    """``n`` threads claim one file at once, over ``journals`` in turn: the intents won, and
    how many lost with FileBusy."""
    start = threading.Barrier(n)
    won: list[int] = []
    lost: list[FileBusy] = []

    def claim(i: int) -> None:
        journal = journals[i % len(journals)]
        start.wait()
        try:
            won.append(journal.claim(file_id, "ssd", reason=f"claim {i}")[0].id)
        except FileBusy as exc:
            lost.append(exc)

    threads = _threads(n, claim, "claim")
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won, len(lost)


def test_of_many_claims_of_one_file_exactly_one_wins(
    eng: Engine, databases: list[Database]
) -> None:
    rec = put(eng, "hot.bin", b"x" * 100)
    journals = [Journal(db) for db in databases]
    for _ in range(10):
        won, lost = _claim_race(journals, rec.id, 8)
        assert len(won) == 1 and lost == 7, (won, lost)
        [intent] = eng.journal.open_intents()
        assert [intent.id] == won
        assert journals[-1].release(intent, phase=MigrationPhase.ABORTED, error="test")
    after = eng.catalog.get(rec.id)
    assert (after.state, after.tier, after.generation) == ("stable", "nvme", rec.generation)


def test_the_switch_commits_only_for_the_intent_that_owns_the_file(
    eng: Engine, databases: list[Database]
) -> None:
    rec = put(eng, "a.bin", b"abc")
    mine, theirs = Journal(databases[0]), Journal(databases[-1])
    intent, _ = mine.claim(rec.id, "ssd", reason="test")
    # Recovery elsewhere (or an admin) closed the intent and gave the file back meanwhile.
    assert theirs.release(intent, phase=MigrationPhase.ABORTED, error="taken back")
    out = mine.switch(intent, checksum=rec.checksum or "", size=3, mtime_ns=1)
    assert not out.committed
    assert eng.catalog.get(rec.id).tier == "nvme"
    # A second intent wins, and the first can no longer switch or release it.
    second, _ = theirs.claim(rec.id, "hdd", reason="test")
    assert not mine.release(intent, phase=MigrationPhase.ABORTED, error="late")
    assert mine.switch(second, checksum=rec.checksum or "", size=3, mtime_ns=1).committed
    assert not theirs.switch(second, checksum="x", size=3, mtime_ns=1).committed  # only once
    now = eng.catalog.get(rec.id)
    assert (now.tier, now.state, now.generation) == ("hdd", "stable", rec.generation + 1)


def test_a_file_a_migration_owns_is_never_deleted(eng: Engine, databases: list[Database]) -> None:
    rec = put(eng, "a.bin", b"abc")
    intent, _ = Journal(databases[-1]).claim(rec.id, "ssd", reason="another host moves it")
    unlinked: list[int] = []
    assert not eng.catalog.delete(
        rec.id, generation=rec.generation, before_commit=lambda r: unlinked.append(r.id)
    )
    assert unlinked == [] and eng.catalog.get(rec.id).state == "migrating"
    Journal(databases[-1]).release(intent, phase=MigrationPhase.ABORTED, error="test")
    assert eng.catalog.delete(rec.id, generation=rec.generation)


def test_ids_are_never_reused(eng: Engine) -> None:
    a = put(eng, "a.bin", b"a")
    eng.delete(a.id)
    b = put(eng, "a.bin", b"a")
    assert b.id > a.id
    m1 = eng.migrate(b.id, "ssd").record.id
    run_sql(eng.config.catalog_url, "DELETE FROM migrations")
    assert eng.migrate(b.id, "nvme").record.id > m1


@pytest.mark.parametrize(
    ("heat", "heat_at", "age_s"),
    [
        (0.0, 0.0, 10.0),
        (5.0, 0.0, 10.0),  # heat_at 0 reads as "now"
        (8.0, 1.0, 3600.0),
        (1e6, 1.0, 86_400.0 * 20),
        (3.0, 1.0, 1e9),  # 2**-huge: 0, not an underflow error
        (3.0, 1.0, -50.0),  # heat_at in the future: no growth
    ],
)
def test_heat_decays_in_sql_as_in_python(
    eng: Engine, heat: float, heat_at: float, age_s: float
) -> None:
    rec = put(eng, "h.bin", b"h")
    with eng.catalog.db.write() as s:
        row = s.get(FileRecord, rec.id)
        assert row is not None
        row.heat = heat
        row.heat_at = heat_at
    now, half_life = heat_at + age_s, 3600.0
    eng.catalog.record_accesses({rec.id: 2}, now=now, half_life_s=half_life)
    got = eng.catalog.get(rec.id)
    want = decay(heat, heat_at, now, half_life) + 2
    assert math.isclose(got.heat, want, rel_tol=1e-12), (got.heat, want)
    assert (got.heat_at, got.access_count, got.last_access) == (now, 2, now)


# -- PostgreSQL: hosts ------------------------------------------------------------------------
def _move_race(hosts: list[Engine], file_id: int, dst: str) -> dict[str, object]:
    """Each host moves the file at the same moment: what each got (a phase, or the error)."""
    start = threading.Barrier(len(hosts))
    lost = threading.Event()
    outcome: dict[str, object] = {}

    def move(i: int) -> None:
        eng = hosts[i]
        # The winner holds its claim until the loser has its answer, so the race is between
        # claims, not between a claim and a finished move.
        eng.mover.hook = lambda step: step == "claimed" and lost.wait(10)
        start.wait()
        try:
            outcome[eng.config.host_id] = eng.migrate(file_id, dst).record.phase
        except (FileBusy, Conflict) as exc:
            outcome[eng.config.host_id] = exc
            lost.set()
        finally:
            eng.mover.hook = None

    threads = _threads(len(hosts), move, "host")
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome


def test_two_hosts_racing_to_move_one_file_move_it_once(tmp_path: Path, pg_url: str) -> None:
    # Two tierd processes (host ids a and b) over one PostgreSQL catalog and the same tier
    # directories (a shared filesystem): both try to move one file at the same moment.
    data = payload(600_000)
    shared = tmp_path / "shared"

    def host(name: str) -> Engine:
        cfg = engine_settings(shared, catalog_url=pg_url, host_id=name, watch=False)
        return Engine(cfg.engine_config())

    with host("a") as a, host("b") as b:
        rec = put(a, "m/shard.bin", data)
        for dst in ("ssd", "hdd", "nvme"):
            outcome = _move_race([a, b], rec.id, dst)
            done = [v for v in outcome.values() if v == MigrationPhase.DONE]
            # The loser is busy, or refused outright: the file is on a's own tiers (records
            # name their host), which b may not move even where it can reach them.
            busy = [v for v in outcome.values() if isinstance(v, Conflict)]
            assert len(done) == 1 and len(busy) == 1, outcome
            assert a.catalog.get(rec.id).tier == dst == b.catalog.get(rec.id).tier
            assert_invariants(a, {"m/shard.bin": data})
        rows = a.journal.list()
        assert [m.phase for m in rows] == [MigrationPhase.DONE] * 3


def test_a_second_tierd_with_the_same_host_id_is_refused(tmp_path: Path, pg_url: str) -> None:
    def host(name: str, root: str) -> Engine:
        cfg = engine_settings(tmp_path / root, catalog_url=pg_url, host_id=name, watch=False)
        return Engine(cfg.engine_config())

    with host("gpu-1", "one"):
        with pytest.raises(Unavailable, match="host id 'gpu-1' is already serving") as err:
            host("gpu-1", "two").start()
        assert "give each host its own host_id" in str(err.value)
        assert "@" in str(err.value) and "postgres" in str(err.value)
        with host("gpu-2", "two"):  # another host is welcome
            pass
    with host("gpu-1", "two"):  # and the id is free again once its holder stopped
        pass


def test_the_host_lock_goes_with_a_killed_process(tmp_path: Path, pg_url: str) -> None:
    import multiprocessing
    import os
    import signal

    from tiering.catalog import CatalogLock

    ctx = multiprocessing.get_context("fork")
    held = ctx.Event()

    def child() -> None:
        lock = CatalogLock(pg_url, host_id="gpu-9")
        lock.acquire()
        held.set()
        time.sleep(60)
        os._exit(0 if lock.held else 1)

    p = ctx.Process(target=child)
    p.start()
    try:
        assert held.wait(30)
        with pytest.raises(Unavailable, match="already serving"):
            CatalogLock(pg_url, host_id="gpu-9").acquire()
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    lock = CatalogLock(pg_url, host_id="gpu-9")

    def taken() -> bool:
        try:
            lock.acquire()
            return True
        except Unavailable:
            return False

    wait_for(taken, what="the server to drop the killed holder's lock")
    lock.release()


def test_a_row_held_past_busy_timeout_is_catalog_busy_and_changes_nothing(
    tmp_path: Path, pg_url: str
) -> None:
    cfg = engine_settings(tmp_path / "data", catalog_url=pg_url, busy_timeout_ms=300)
    with Engine(cfg.engine_config()) as eng:
        data = payload(1000)
        rec = put(eng, "a.bin", data)
        import psycopg

        other = psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql"))
        try:
            other.execute("SELECT id FROM files WHERE id = %s FOR UPDATE", (rec.id,))
            with pytest.raises(CatalogBusy, match="busy_timeout"):
                eng.migrate(rec.id, "ssd")
            with pytest.raises(CatalogBusy):
                eng.pin(rec.id, "nvme")
        finally:
            other.rollback()
            other.close()
        assert eng.catalog.get(rec.id).generation == rec.generation
        assert eng.journal.open_intents() == []
        assert_invariants(eng, {"a.bin": data})
        eng.migrate(rec.id, "ssd")  # and once the row is free, it moves
        assert_invariants(eng, {"a.bin": data})


def _waiting_on_locks(url: str) -> int:
    rows = run_sql(
        url,
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    return int(rows[0][0])


@postgresql_only
def test_a_write_that_lost_a_deadlock_runs_again(eng: Engine, databases: list[Database]) -> None:
    a, b = put(eng, "a.bin", b"a"), put(eng, "b.bin", b"b")
    both_locked_one = threading.Barrier(2)
    runs: list[str] = []
    errors: list[BaseException] = []

    def body(name: str, first: int, second: int, s: Session) -> None:
        runs.append(name)
        s.get(FileRecord, first, with_for_update=FOR_WRITE)
        if runs.count(name) == 1:
            both_locked_one.wait(10)  # each holds one row and wants the other's
        row = s.get(FileRecord, second, with_for_update=FOR_WRITE)
        assert row is not None
        row.detail = name

    def run(i: int) -> None:
        name, first, second = ("x", a.id, b.id) if i == 0 else ("y", b.id, a.id)
        try:
            databases[i].transact(lambda s: body(name, first, second, s))
        except BaseException as exc:
            errors.append(exc)

    threads = _threads(2, run, "deadlock")
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # PostgreSQL aborted one of the two; it ran again after the other committed. On a loaded
    # machine the retry may take its first row back before the winner gets it, and deadlock
    # once more (the other one loses then): each write ran at most RETRIES + 1 times.
    assert len(runs) >= 3 and set(runs) == {"x", "y"}
    assert max(runs.count("x"), runs.count("y")) <= Database.RETRIES + 1
    # ...and both committed, each its own write.
    assert (eng.catalog.get(a.id).detail, eng.catalog.get(b.id).detail) == ("y", "x")


@postgresql_only
def test_hosts_recording_the_same_new_file_at_once_make_one_record(
    eng: Engine, databases: list[Database], pg_url: str
) -> None:
    import psycopg

    # A third writer inserts the relpath and holds its transaction open: both hosts' inserts of
    # the same relpath wait on it, then both fail the unique check when it commits, and both
    # run again, finding its record.
    blocker = psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql"))
    blocker.execute(
        "INSERT INTO files (relpath, tier, size, mtime_ns, state, generation, access_count,"
        " heat, heat_at, created_at, updated_at) VALUES ('new.bin', 'nvme', 1, 1, 'stable', 0,"
        " 0, 0, 0, 0, 0)"
    )
    got: list[FileRecord | None] = []
    errors: list[BaseException] = []

    def record(i: int) -> None:
        try:
            # Each host's own write (its own mtime): two changes of content, not one twice.
            news = [NewFile("new.bin", "nvme", 5, 5 + i, "c" * 16)]
            got.extend(Catalog(databases[i + 1]).upsert_many(news))
        except BaseException as exc:
            errors.append(exc)

    threads = _threads(2, record, "upsert")
    try:
        for t in threads:
            t.start()
        wait_for(lambda: _waiting_on_locks(pg_url) >= 2, what="both inserts to wait")
        blocker.commit()
    finally:
        for t in threads:
            t.join()
        blocker.close()
    assert errors == []
    with eng.catalog.db.read() as s:
        [row] = s.scalars(select(FileRecord).where(FileRecord.relpath == "new.bin"))
    assert {r.id for r in got if r is not None} == {row.id}
    assert (row.generation, row.size) == (2, 5)  # each host's write replaced the content once
