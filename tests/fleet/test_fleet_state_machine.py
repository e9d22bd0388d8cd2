"""Issue 15: concurrent moves of the same shared file from two hosts never corrupt the catalog.

A Hypothesis state machine drives two in-process engines (``host-a`` and ``host-b``, each with
its own ``nvme`` directory in its own data directory) over ONE real PostgreSQL catalog and one
shared object tier on a real S3-protocol server (moto). Each step draws the acting host:
uploads to a host's nvme or to the bucket, demotions of a host's own file to the bucket, moves
that must be refused (another host's file; an origin file onto a host tier), copies of shared
files filled and dropped, overwrites and deletes, and the races the issue names: the same
shared file acted on from both hosts at once, in two threads.

After every step the catalog is read fresh and the disks and the bucket directly: each file
has one authoritative place with the expected bytes; no intent is open; every copy row names
a file and its copy file (current ones with the current bytes); each engine loads the expected
bytes of every file it can reach, never a stale copy; no temp is left; a reconcile leaves each
copies directory matching its rows, and a second one changes nothing.

Small by default (a few examples of a dozen steps); ``--runslow`` runs a bigger budget.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from tests.conftest import make_settings
from tests.helpers import checksum, put
from tests.pg_support import PgServer
from tests.s3 import REGION
from tiering.catalog import Copies, FileRecord, FileState, MigrationPhase
from tiering.copies.hostcopies import HostCopies
from tiering.engine import Engine
from tiering.errors import AlreadyExists, Conflict, NotFound, TierdError
from tiering.tiers.paths import RESERVED_DIR, is_temp_name

HOSTS = ("host-a", "host-b")
SHARED = "shared"  # the model's place of a file in the bucket (the fleet's origin)
NAMES = [f"m{i % 2}/f{i}" for i in range(5)]
#: The errors a refused or lost race is documented to raise (conflict, busy, changed, not found);
#: anything else fails the test.
ACCEPTED: tuple[type[TierdError], ...] = (Conflict, NotFound)

sizes = st.integers(0, 48_000)
seeds = st.integers(0, 2**32 - 1)
#: Which file of those a rule may act on. Drawn as a plain index, never from the model's
#: current files: a race's outcome decides those, and draws that depend on it would make
#: Hypothesis see the same choices lead to different draws (FlakyStrategyDefinition).
picks = st.integers(0, 15)


def _pick(pool: list[str], i: int) -> str | None:
    return pool[i % len(pool)] if pool else None


def _bytes(size: int, seed: int) -> bytes:
    """Bytes drawn from a seed, so a failing example replays with the same content."""
    return random.Random(seed).randbytes(size)


def _write(eng: Engine, name: str, data: bytes, tier: str | None = None) -> FileRecord:
    """Overwrite ``name`` (by default where it is)."""
    with eng.begin_upload(name, tier=tier, overwrite=True) as up:
        up.write(data)
        return up.commit()


@dataclass
class Fleet:
    """The session's servers, and this test's bucket: what every example shares."""

    pg: PgServer
    endpoint: str
    bucket: str
    s3: Any  # a boto3 client, reading the bucket behind tierd's back


@dataclass
class Expected:
    data: bytes
    place: str  # a host id (its nvme) or SHARED


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Race:
    """Two actions started together (a barrier), each in its own thread."""

    actions: list[Callable[[], Any]]
    outcomes: list[Outcome] = field(default_factory=list)

    def run(self) -> list[Outcome]:
        barrier = threading.Barrier(len(self.actions))
        self.outcomes = [Outcome() for _ in self.actions]

        def go(i: int) -> None:
            barrier.wait()
            try:
                self.outcomes[i].value = self.actions[i]()
            except BaseException as exc:  # judged below, in the test's thread
                self.outcomes[i].error = exc

        threads = [
            threading.Thread(target=go, args=(i,), name=f"sm-race-{i}")
            for i in range(len(self.actions))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for o in self.outcomes:
            check_refusal(o)
        return self.outcomes


def check_refusal(o: Outcome) -> None:
    """A failed action must have failed with a documented refusal."""
    if o.error is not None and not isinstance(o.error, ACCEPTED):
        raise AssertionError(f"undocumented error: {o.error!r}") from o.error


def attempt(fn: Callable[[], Any]) -> Outcome:
    try:
        return Outcome(fn())
    except BaseException as exc:
        o = Outcome(error=exc)
        check_refusal(o)
        return o


class FleetMachine(RuleBasedStateMachine):
    fleet: Fleet  # set on the subclass the test builds

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tierd-fleet-sm-"))
        self.dbname = self.fleet.pg.create_database(migrated=True)
        self.prefix = f"sm-{uuid.uuid4().hex[:12]}"  # a fresh origin per example
        self.model: dict[str, Expected] = {}
        self.engines: dict[str, Engine] = {}
        for host in HOSTS:
            self.engines[host] = self._start(host)

    def _start(self, host: str) -> Engine:
        root = self.root / host
        cfg = make_settings(
            root,
            host_id=host,
            catalog_url=self.fleet.pg.url(self.dbname),
            watch=False,
            tiers=[
                {"name": "nvme", "path": root / "nvme"},
                {
                    "name": "s3",
                    "url": f"s3://{self.fleet.bucket}/{self.prefix}",
                    "endpoint_url": self.fleet.endpoint,
                    "region": REGION,
                    "connections": 2,
                },
            ],
        ).engine_config()
        return Engine(cfg).start(scheduler=False)  # the machine makes every move itself

    def teardown(self) -> None:
        for eng in self.engines.values():
            eng.stop()
        self.fleet.pg.drop_database(self.dbname)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- helpers -------------------------------------------------------------------------------
    def _hc(self, host: str) -> HostCopies:
        hc = self.engines[host].host_copies
        assert hc is not None, "a shared catalog with a bucket keeps host copies"
        return hc

    def _nvme(self, host: str) -> Path:
        root = self.engines[host].tiers.get("nvme").local_root
        assert root is not None
        return root

    def _id(self, name: str) -> int:
        return self.engines[HOSTS[0]].lookup(name).id

    def _names(self, place: str | None = None, *, not_place: str | None = None) -> list[str]:
        return sorted(
            n
            for n, e in self.model.items()
            if (place is None or e.place == place) and (not_place is None or e.place != not_place)
        )

    def _owned(self) -> list[str]:
        return self._names(not_place=SHARED)

    def _shared(self) -> list[str]:
        return self._names(SHARED)

    def _snapshot(self, name: str) -> tuple[Any, ...]:
        r = self.engines[HOSTS[0]].lookup(name)
        return (r.id, r.tier, r.host, r.state, r.generation, r.checksum, r.size, r.etag)

    def _object(self, relpath: str) -> bytes | None:
        try:
            obj = self.fleet.s3.get_object(Bucket=self.fleet.bucket, Key=f"{self.prefix}/{relpath}")
        except self.fleet.s3.exceptions.NoSuchKey:
            return None
        return bytes(obj["Body"].read())

    # -- uploads -------------------------------------------------------------------------------
    @rule(
        host=st.sampled_from(HOSTS),
        name=st.sampled_from(NAMES),
        to=st.sampled_from(["nvme", "s3"]),
        size=sizes,
        seed=seeds,
    )
    def upload(self, host: str, name: str, to: str, size: int, seed: int) -> None:
        data = _bytes(size, seed)
        if name in self.model:
            # Relpaths are unique across the fleet: another host's (or the bucket's) file
            # of that name is refused, and stays as it was.
            before = self._snapshot(name)
            with pytest.raises(AlreadyExists):
                put(self.engines[host], name, data, tier=to)
            assert self._snapshot(name) == before
            return
        put(self.engines[host], name, data, tier=to)
        self.model[name] = Expected(data, host if to == "nvme" else SHARED)

    @rule(pick=picks, host=st.sampled_from(HOSTS), size=sizes, seed=seeds)
    def overwrite_shared(self, pick: int, host: str, size: int, seed: int) -> None:
        name = _pick(self._shared(), pick)
        if name is None:
            return  # nothing to act on yet (a no-op keeps the draws the same whatever the state)
        new = _bytes(size, seed)
        gen = self.engines[host].lookup(name).generation
        rec = _write(self.engines[host], name, new)
        assert (rec.tier, rec.host) == ("s3", None)  # an overwrite stays where the file is
        assert rec.generation > gen  # every host's copy of the old bytes is now stale
        self.model[name].data = new

    @rule(pick=picks, to=st.sampled_from([None, "nvme", "s3"]), size=sizes, seed=seeds)
    def overwrite_another_host_s_file(
        self, pick: int, to: str | None, size: int, seed: int
    ) -> None:
        name = _pick(self._owned(), pick)
        if name is None:
            return  # nothing to act on yet (a no-op keeps the draws the same whatever the state)
        other = next(h for h in HOSTS if h != self.model[name].place)
        before = self._snapshot(name)
        with pytest.raises(Conflict):
            _write(self.engines[other], name, _bytes(size, seed), tier=to)
        assert self._snapshot(name) == before

    # -- moves ---------------------------------------------------------------------------------
    @rule(pick=picks)
    def demote_own_file(self, pick: int) -> None:
        name = _pick(self._owned(), pick)
        if name is None:
            return  # nothing to act on yet (a no-op keeps the draws the same whatever the state)
        owner = self.model[name].place
        self.engines[owner].migrate(self._id(name), "s3")
        self.model[name].place = SHARED

    @rule(pick=picks, to=st.sampled_from(["s3", "nvme"]))
    def move_another_host_s_file(self, pick: int, to: str) -> None:
        name = _pick(self._owned(), pick)
        if name is None:
            return  # nothing to act on yet (a no-op keeps the draws the same whatever the state)
        other = next(h for h in HOSTS if h != self.model[name].place)
        before = self._snapshot(name)
        o = attempt(lambda: self.engines[other].migrate(self._id(name), to))
        assert not o.ok, f"{other} moved {name}, a file on another host's disk"
        assert self._snapshot(name) == before

    @rule(pick=picks, host=st.sampled_from(HOSTS))
    def move_an_origin_file_to_a_host(self, pick: int, host: str) -> None:
        name = _pick(self._shared(), pick)
        if name is None:
            return  # nothing to act on yet (a no-op keeps the draws the same whatever the state)
        before = self._snapshot(name)
        with pytest.raises(Conflict):
            self.engines[host].migrate(self._id(name), "nvme")
        assert self._snapshot(name) == before

    # -- copies --------------------------------------------------------------------------------
    @rule(pick=picks, host=st.sampled_from(HOSTS))
    def fill_copy(self, pick: int, host: str) -> None:
        name = _pick(self._shared(), pick)
        if name is None:
            return  # nothing to act on yet (a no-op keeps the draws the same whatever the state)
        rec = self.engines[host].lookup(name)
        entry = self._hc(host).fill(rec.id, "nvme")
        assert (entry.file_id, entry.generation, entry.tier) == (rec.id, rec.generation, "nvme")

    @rule(pick=picks, host=st.sampled_from(HOSTS))
    def drop_copy(self, pick: int, host: str) -> None:
        name = _pick(self._shared(), pick)
        if name is None:
            return  # nothing to act on yet (a no-op keeps the draws the same whatever the state)
        fid = self._id(name)
        had = self._hc(host).get(fid) is not None
        assert self._hc(host).drop(fid) == had
        assert self._hc(host).get(fid) is None

    # -- deletes -------------------------------------------------------------------------------
    @rule(pick=picks, host=st.sampled_from(HOSTS))
    def delete(self, pick: int, host: str) -> None:
        name = _pick(sorted(self.model), pick)
        if name is None:
            return  # nothing to act on yet (a no-op keeps the draws the same whatever the state)
        place = self.model[name].place
        if place not in (SHARED, host):
            # Another host's file is on its disk: this host cannot remove its bytes, so it
            # must not remove its record either.
            before = self._snapshot(name)
            o = attempt(lambda: self.engines[host].delete(self._id(name)))
            assert not o.ok, f"{host} deleted {name}, a file on another host's disk"
            assert self._snapshot(name) == before
            return
        self.engines[host].delete(self._id(name))
        del self.model[name]

    # -- races on one shared file from both hosts ----------------------------------------------
    @rule(pick=picks, filler=st.sampled_from(HOSTS), size=sizes, seed=seeds)
    def race_fill_against_overwrite(self, pick: int, filler: str, size: int, seed: int) -> None:
        name = _pick(self._shared(), pick)
        if name is None:
            return  # nothing to act on yet (a no-op keeps the draws the same whatever the state)
        writer = next(h for h in HOSTS if h != filler)
        fid, new = self._id(name), _bytes(size, seed)

        fill, write = Race(
            [
                lambda: self._hc(filler).fill(fid, "nvme"),
                lambda: _write(self.engines[writer], name, new),
            ]
        ).run()
        if write.ok:
            self.model[name].data = new

    @rule(pick=picks, filler=st.sampled_from(HOSTS))
    def race_fill_against_delete(self, pick: int, filler: str) -> None:
        name = _pick(self._shared(), pick)
        if name is None:
            return  # nothing to act on yet (a no-op keeps the draws the same whatever the state)
        deleter = next(h for h in HOSTS if h != filler)
        fid = self._id(name)
        _fill, gone = Race(
            [lambda: self._hc(filler).fill(fid, "nvme"), lambda: self.engines[deleter].delete(fid)]
        ).run()
        if gone.ok:
            del self.model[name]

    @rule(pick=picks)
    def race_fill_against_fill(self, pick: int) -> None:
        name = _pick(self._shared(), pick)
        if name is None:
            return
        fid = self._id(name)
        outcomes = Race([partial(self._hc(h).fill, fid, "nvme") for h in HOSTS]).run()
        assert all(o.ok for o in outcomes), outcomes  # nothing else changes the file

    @rule(pick=picks)
    def race_demote_against_foreign_move(self, pick: int) -> None:
        name = _pick(self._owned(), pick)
        if name is None:
            return  # nothing to act on yet (a no-op keeps the draws the same whatever the state)
        owner = self.model[name].place
        other = next(h for h in HOSTS if h != owner)
        fid = self._id(name)
        mine, theirs = Race(
            [
                lambda: self.engines[owner].migrate(fid, "s3"),
                lambda: self.engines[other].migrate(fid, "s3"),
            ]
        ).run()
        assert not theirs.ok, f"{other} moved {name}, a file on another host's disk"
        if mine.ok:
            self.model[name].place = SHARED

    # Not both to the bucket: moto checks a completion's If-None-Match apart from the
    # completion itself, so two completions can both pass it (S3 checks atomically).
    @rule(
        name=st.sampled_from(NAMES),
        to=st.sampled_from([("nvme", "nvme"), ("nvme", "s3"), ("s3", "nvme")]),
        size=sizes,
        seed=seeds,
    )
    def race_upload_against_upload(
        self, name: str, to: tuple[str, str], size: int, seed: int
    ) -> None:
        if name in self.model:
            return
        to_a, to_b = to
        datas = [_bytes(size, seed), _bytes(size + 1, seed + 1)]
        places = [HOSTS[0] if to_a == "nvme" else SHARED, HOSTS[1] if to_b == "nvme" else SHARED]
        outcomes = Race(
            [
                lambda: put(self.engines[HOSTS[0]], name, datas[0], tier=to_a),
                lambda: put(self.engines[HOSTS[1]], name, datas[1], tier=to_b),
            ]
        ).run()
        won = [i for i, o in enumerate(outcomes) if o.ok]
        assert len(won) == 1, outcomes  # a new relpath is one host's: the other is refused
        self.model[name] = Expected(datas[won[0]], places[won[0]])

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def one_authoritative_place_each(self) -> None:
        eng = self.engines[HOSTS[0]]
        records = {r.relpath: r for r in eng.catalog.all()}  # PostgreSQL: read fresh
        assert set(records) == set(self.model)
        keys = self.fleet.s3.list_objects_v2(Bucket=self.fleet.bucket, Prefix=f"{self.prefix}/")
        in_bucket = {o["Key"][len(self.prefix) + 1 :] for o in keys.get("Contents", [])}
        assert in_bucket == set(self._shared()), (in_bucket, self._shared())
        for host in HOSTS:
            assert self._own_files(host) == set(self._names(host)), host
        for name, want in self.model.items():
            rec = records[name]
            assert rec.state == FileState.STABLE, (name, rec.state, rec.detail)
            assert (rec.size, rec.checksum) == (len(want.data), checksum(want.data)), name
            if want.place == SHARED:
                assert (rec.tier, rec.host) == ("s3", None), name
                assert self._object(name) == want.data, name
            else:
                assert (rec.tier, rec.host) == ("nvme", want.place), name
                assert (self._nvme(want.place) / name).read_bytes() == want.data, name
        for e in self.engines.values():
            assert e.journal.list(phases=list(MigrationPhase.OPEN)) == []
            for tier in e.tiers:
                assert list(tier.temps()) == [], f"unfinished uploads on {tier.name}"

    def _own_files(self, host: str) -> set[str]:
        """Relpaths of the files in the host's nvme outside its copies directory; no temps."""
        root, out = self._nvme(host), set()
        for dirpath, _dirs, files in os.walk(root):
            for f in files:
                assert not is_temp_name(f), f"temp left on {host}: {dirpath}/{f}"
                rel = os.path.relpath(os.path.join(dirpath, f), root)
                if not rel.startswith(RESERVED_DIR + "/"):
                    out.add(rel)
        return out

    @invariant()
    def copies_are_recorded_and_never_stale(self) -> None:
        eng = self.engines[HOSTS[0]]
        records = {r.id: r for r in eng.catalog.all()}
        ids = {r.relpath: i for i, r in records.items()}
        for row in Copies(eng.catalog.db).list():
            assert row.file_id in records, row
            rec = records[row.file_id]
            assert row.location == "nvme", row
            path = self._nvme(row.host) / RESERVED_DIR / f"{row.file_id}.{row.generation}"
            assert path.is_file(), (row, "its copy file is gone")
            if row.generation == rec.generation:
                assert path.read_bytes() == self.model[rec.relpath].data, row
        # Every engine loads the expected bytes of each file it can reach: its own and the
        # bucket's (through a current copy or the origin), never a stale copy.
        for host, e in self.engines.items():
            for name in self._names(host) + self._shared():
                content = e.open_content(ids[name])
                try:
                    got = b"".join(content.iter_range(0, content.size))
                finally:
                    content.close()
                assert got == self.model[name].data, (host, name)

    @invariant()
    def reconcile_leaves_disk_and_rows_agreeing(self) -> None:
        db = self.engines[HOSTS[0]].catalog.db
        for host in HOSTS:
            hc = self._hc(host)
            hc.reconcile()  # a deleted or overwritten file's leftovers go here
            again = hc.reconcile()
            assert (again.temps, again.files, again.rows) == (0, 0, 0), (host, again)
            rows = {(r.file_id, r.generation) for r in Copies(db).list(host=host)}
            d = self._nvme(host) / RESERVED_DIR
            names = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
            assert sorted(f"{f}.{g}" for f, g in rows) == names, (host, rows, names)


class WithConcurrentOverwrites(FleetMachine):
    """Adds both hosts overwriting one shared file at once: they take turns from the bucket's
    change to the catalog's (`Database.publish_lock`), so the record names the winner's bytes."""

    @rule(pick=picks, size=sizes, seed=seeds)
    def race_overwrite_against_overwrite(self, pick: int, size: int, seed: int) -> None:
        name = _pick(self._shared(), pick)
        if name is None:
            return  # nothing to act on yet (a no-op keeps the draws the same whatever the state)
        datas = [_bytes(size, seed), _bytes(size + 1, seed + 1)]
        outcomes = Race(
            [partial(_write, self.engines[h], name, d) for h, d in zip(HOSTS, datas, strict=True)]
        ).run()
        won = [i for i, o in enumerate(outcomes) if o.ok]
        assert won, outcomes
        rec = self.engines[HOSTS[0]].lookup(name)
        [self.model[name].data] = [datas[i] for i in won if checksum(datas[i]) == rec.checksum]


def _run(fleet: Fleet, budget: settings, machine: type[FleetMachine] = FleetMachine) -> None:
    machine = type("BoundFleetMachine", (machine,), {"fleet": fleet})
    run_state_machine_as_test(machine, settings=budget)


@pytest.fixture
def fleet(
    pg_server: PgServer, moto_endpoint: str, s3_bucket: str, s3_client: Any, s3_env: Any
) -> Fleet:
    return Fleet(pg_server, moto_endpoint, s3_bucket, s3_client)


# The default run: a few short histories (about a third of the time of 10 x 16 steps); the long
# run below (--runslow) explores 60 x 30.
_SMALL = settings(
    max_examples=4,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_two_hosts_on_one_catalog_never_corrupt_it(fleet: Fleet) -> None:
    _run(fleet, _SMALL)


@pytest.mark.slow
def test_two_hosts_on_one_catalog_never_corrupt_it_long(fleet: Fleet) -> None:
    _run(
        fleet,
        settings(
            _SMALL,
            max_examples=60,
            stateful_step_count=30,
        ),
    )


def test_concurrent_overwrites_of_one_shared_file(fleet: Fleet) -> None:
    _run(fleet, _SMALL, WithConcurrentOverwrites)
