"""kill -9 of a host copy's fill at each of its steps, on a fleet's catalog (real PostgreSQL)
with the object in a real bucket (moto).

A forked child opens the engine and fills a copy of the object on its nvme; it SIGKILLs itself
at the step under test. The steps are found at the boundary with the OS, not inside tierd: the
child wraps ``os.open``/``os.write``/``os.fsync``/``os.rename`` to kill itself when the fill
creates its temp in the copies directory, halfway through writing it, once it is fsynced, and
once it is renamed to the copy's name (before the row); the last step kills it once ``fill``
returned (after the row). The child's state is then checked on disk and in the catalog, so each
round proves it died where it says. A fresh engine then starts (its reconcile runs) and: the
object is intact and still the file's home, no temp is left, and there is either a complete
copy, byte-equal to the object, with its row, or neither; a second reconcile changes nothing,
and a new fill works. CI runs two steps; ``--runslow`` runs every one.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import disk_snapshot
from tests.fleet.copy_support import PREFIX, copy_bytes, fleet_config, hc, held, started
from tiering.catalog import Copies, Database
from tiering.config import EngineConfig
from tiering.engine import Engine
from tiering.tiers.paths import RESERVED_DIR, TEMP_SUFFIX

KiB = 1 << 10
REL = "w.bin"
STEPS = ("temp_created", "mid_write", "fsynced", "renamed", "recorded")
QUICK = ("mid_write", "renamed")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_at(step: str, copies_dir: Path) -> None:
    """Wrap the ``os`` calls a fill makes so the process dies at ``step`` (this process only:
    it is a forked child that never returns)."""
    real_open, real_write, real_fsync, real_rename = os.open, os.write, os.fsync, os.rename
    temps: set[int] = set()

    def in_copies(path: Any, dir_fd: int | None) -> bool:
        # The tier's writer names files relative to its directory's fd.
        where = Path(os.readlink(f"/proc/self/fd/{dir_fd}")) if dir_fd is not None else Path()
        return (where / os.fsdecode(path)).parent == copies_dir.resolve()

    def open_(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        fd = real_open(path, flags, *args, **kw)
        if in_copies(path, kw.get("dir_fd")) and os.fsdecode(path).endswith(TEMP_SUFFIX):
            temps.add(fd)
            if step == "temp_created":
                _die()
        return fd

    def write(fd: int, data: Any) -> int:
        if fd in temps and step == "mid_write":
            view = memoryview(data)
            real_write(fd, view[: len(view) // 2])  # a torn write: half its bytes reach the file
            _die()
        return real_write(fd, data)

    def fsync(fd: int) -> None:
        real_fsync(fd)
        if fd in temps and step == "fsynced":
            _die()

    def rename(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
        real_rename(src, dst, *args, **kw)
        if in_copies(dst, kw.get("dst_dir_fd")) and step == "renamed":
            _die()  # before the directory's fsync and the row

    os.open, os.write, os.fsync, os.rename = open_, write, fsync, rename  # type: ignore[assignment]


def _child(config: EngineConfig, file_id: int, step: str, copies_dir: Path) -> None:
    try:
        eng = Engine(config).open()  # as a serving process has it: no thread runs a pass
        _kill_at(step, copies_dir)
        hc(eng).fill(file_id, "nvme")
        if step == "recorded":
            _die()
    finally:
        os._exit(3)  # reached only if the step never came


def _crash(config: EngineConfig, file_id: int, step: str, copies_dir: Path) -> None:
    p = multiprocessing.get_context("fork").Process(
        target=_child, args=(config, file_id, step, copies_dir)
    )
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL, f"child exit code {p.exitcode} at step {step}"


def _rows(catalog_url: str) -> list[tuple[int, str, str, int, int]]:
    db = Database(catalog_url)
    try:
        return [(r.file_id, r.host, r.location, r.generation, r.size) for r in Copies(db).list()]
    finally:
        db.dispose()


def _assert_died_at(step: str, names: list[str], rows: list[Any], final: str, size: int,
                    d: Path) -> None:  # fmt: skip
    temps = [n for n in names if n.endswith(TEMP_SUFFIX)]
    if step in ("temp_created", "mid_write", "fsynced"):
        assert names == temps and len(temps) == 1, names
        written = (d / temps[0]).stat().st_size
        expected: Callable[[int], bool] = {
            "temp_created": lambda n: n == 0,
            "mid_write": lambda n: 0 < n < size,
            "fsynced": lambda n: n == size,
        }[step]
        assert expected(written), (step, written, size)
        assert rows == []
    else:
        assert names == [final], names
        assert (d / final).stat().st_size == size
        assert len(rows) == (1 if step == "recorded" else 0), rows


@pytest.mark.parametrize(
    "step", [s if s in QUICK else pytest.param(s, marks=pytest.mark.slow) for s in STEPS]
)
def test_kill_9_of_a_copy_fill_at_each_step(
    step: str,
    tmp_path: Path,
    pg_url: str,
    moto_endpoint: str,
    s3_bucket: str,
    s3_client: Any,
    s3_env: Any,
) -> None:
    data = os.urandom(3 * 64 * KiB + 5)
    s3_client.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/{REL}", Body=data)
    config = fleet_config(tmp_path, "host-a", pg_url, moto_endpoint, s3_bucket, dirs=("nvme",))
    with started(config) as eng:  # adopts the object
        rec = eng.lookup(REL)
    d = tmp_path / "nvme" / RESERVED_DIR
    final = f"{rec.id}.{rec.generation}"

    _crash(config, rec.id, step, d)
    _assert_died_at(step, sorted(os.listdir(d)), _rows(pg_url), final, len(data), d)

    committed = step == "recorded"
    with started(config) as eng:  # reconciles the copies before anything else
        obj = s3_client.get_object(Bucket=s3_bucket, Key=f"{PREFIX}/{REL}")["Body"].read()
        assert obj == data  # the origin is untouched...
        cur = eng.get(rec.id)
        assert (cur.tier, cur.generation, cur.size) == ("s3", rec.generation, len(data))
        assert cur.state == "stable"  # ...and still the file's one home
        names = sorted(os.listdir(d))
        assert not [n for n in names if n.endswith(TEMP_SUFFIX)]
        if committed:
            assert held(eng) == {rec.id: "nvme"}  # the copy, its row and the index agree
            assert copy_bytes(eng, rec.id) == data
            assert _rows(pg_url) == [(rec.id, "host-a", "nvme", rec.generation, len(data))]
        else:
            assert names == [] and held(eng) == {} and _rows(pg_url) == []

        before = (disk_snapshot(tmp_path / "nvme"), _rows(pg_url))
        again = hc(eng).reconcile()
        assert (again.temps, again.files, again.rows) == (0, 0, 0)
        assert (disk_snapshot(tmp_path / "nvme"), _rows(pg_url)) == before

        # And the host goes on: a fill now makes (or finds) the complete copy.
        hc(eng).fill(rec.id, "nvme")
        assert held(eng) == {rec.id: "nvme"} and copy_bytes(eng, rec.id) == data
