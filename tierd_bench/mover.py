"""``tierd bench mover``: the migration copy path against ``cp`` across two filesystems.

Writes one file of ``size`` bytes under ``src``, then, from a warm page cache and in both
directions, times:

- ``cp`` + ``sync FILE`` (an fsync of the copy) against tierd's copy path (claim to publish:
  copy and xxh3 hash in one pass, fsync, verify, no-clobber publish, directory fsync);
- ``cp`` + ``sync`` + ``rm`` of the source (what a careful ``mv`` does) against the whole
  migration (the above plus the catalog switch, source unlink and directory fsync);
- one more migration under a bandwidth cap, which should run at about the cap.

Rates are MiB/s, medians of ``repeats``; ratios are tierd's rate over ``cp``'s.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tiering.config import EngineConfig, TierConfig
from tiering.engine import Engine

from ._measure import MiB, format_size
from ._report import BenchRow, Report

__all__ = ["run"]


def _fstype(path: Path) -> str | None:
    """The filesystem type of the mount holding ``path`` (Linux), to name each direction."""
    best, kind = "", None
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return None
    target = str(path.resolve())
    for mount, fstype in mounts:
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


def _fill(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        block = os.urandom(4 * MiB)
        left = size
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())


def run(
    size: int,
    src: Path,
    dst: Path,
    repeats: int = 3,
    cap_mib_s: float | None = 100.0,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Time ``cp``+fsync and tierd migrations of one ``size``-byte file from ``src`` to ``dst``
    and back; with ``cap_mib_s``, one more migration under that bandwidth cap."""
    if size < 1 or repeats < 1:
        raise ValueError("size and repeats must be at least 1")
    a = Path(tempfile.mkdtemp(prefix="tierd-bench-", dir=src))
    b = Path(tempfile.mkdtemp(prefix="tierd-bench-", dir=dst))
    try:
        cfg = EngineConfig(
            tiers=(TierConfig("a", a / "tier"), TierConfig("b", b / "tier")),
            catalog_url=f"sqlite:///{a / 'catalog.db'}",
            scan_on_start=False,
        )
        eng = Engine(cfg).start(scheduler=False)
        try:
            eng.set_policy(
                eng.policy().document() | {"bandwidth_bytes_per_s": None, "enabled": False}
            )
            say(f"writing {format_size(size)} under {a}; moving it to {b} and back")
            _fill(a / "tier" / "f.bin", size)
            eng.scan()
            fid = eng.lookup("f.bin").id
            # Both directions, so each side's fsync cost shows; cp gets the same fsync, and
            # the full move is compared with cp + sync + rm of the source (what mv does).
            keys = ("a->b", "b->a")
            t: dict[str, dict[str, list[float]]] = {
                k: {"cp": [], "cp_rm": [], "copy": [], "move": []} for k in keys
            }
            marks: dict[str, float] = {}
            eng.mover.hook = lambda step: marks.__setitem__(step, time.perf_counter())
            for _ in range(repeats):
                for here, there in (("a", "b"), ("b", "a")):
                    key = f"{here}->{there}"
                    src_file = _root(eng, here) / "f.bin"
                    tmp = _root(eng, here) / "cp-src.bin"
                    os.link(src_file, tmp)  # a second name, so rm frees nothing tierd needs
                    dst_file = _root(eng, there) / "cp.bin"
                    t0 = time.perf_counter()
                    subprocess.run(["cp", str(tmp), str(dst_file)], check=True)
                    subprocess.run(["sync", str(dst_file)], check=True)
                    t1 = time.perf_counter()
                    os.unlink(tmp)
                    t[key]["cp"].append(t1 - t0)
                    os.unlink(dst_file)
                    # cp + rm of a file whose last name goes (the data is freed, as in a move)
                    scratch = _root(eng, here) / "scratch.bin"
                    shutil.copyfile(src_file, scratch)
                    t0 = time.perf_counter()
                    subprocess.run(["cp", str(scratch), str(dst_file)], check=True)
                    subprocess.run(["sync", str(dst_file)], check=True)
                    os.unlink(scratch)
                    t[key]["cp_rm"].append(time.perf_counter() - t0)
                    os.unlink(dst_file)
                    t0 = time.perf_counter()
                    eng.migrate(fid, there)
                    t[key]["move"].append(time.perf_counter() - t0)
                    t[key]["copy"].append(marks["published"] - marks["claimed"])
            eng.mover.hook = None
            capped: float | None = None
            if cap_mib_s:
                say(f"one more migration capped at {cap_mib_s:g} MiB/s")
                eng.set_policy(
                    eng.policy().document() | {"bandwidth_bytes_per_s": int(cap_mib_s * MiB)}
                )
                t0 = time.perf_counter()
                eng.migrate(fid, "b" if eng.get(fid).tier == "a" else "a")
                capped = size / MiB / (time.perf_counter() - t0)
        finally:
            eng.stop()
        return _report(t, size, src, dst, repeats, cap_mib_s, capped)
    finally:
        shutil.rmtree(a, ignore_errors=True)
        shutil.rmtree(b, ignore_errors=True)


def _report(
    times: dict[str, dict[str, list[float]]],
    size: int,
    src: Path,
    dst: Path,
    repeats: int,
    cap_mib_s: float | None,
    capped: float | None,
) -> Report:
    fs = {"a": _fstype(src) or "?", "b": _fstype(dst) or "?"}
    report = Report(
        "mover",
        f"tierd bench mover: {format_size(size)} file, {src} ({fs['a']}) <-> {dst} ({fs['b']}), "
        f"warm page cache, medians of {repeats}",
        {
            "size_bytes": size,
            "src": str(src),
            "src_fstype": fs["a"],
            "dst": str(dst),
            "dst_fstype": fs["b"],
            "repeats": repeats,
            "cap_mib_s": cap_mib_s,
        },
    )
    # "src (ext4) -> dst (tmpfs)": both ends named, as both may be of one type.
    ends = {"a": f"src ({fs['a']})", "b": f"dst ({fs['b']})"}
    for direction, ts in times.items():
        here, there = direction.split("->")
        key, name = direction.replace("->", "_"), f"{ends[here]} -> {ends[there]}"
        rate = {k: size / MiB / statistics.median(v) for k, v in ts.items()}
        for what, label, vs, vs_label in (
            ("copy", "tierd copy path", "cp", "cp + sync"),
            ("move", "tierd whole move", "cp_rm", "cp + sync + rm"),
        ):
            report.add(BenchRow(f"{key}_{vs}", f"{vs_label}, {name}", rate[vs], "MiB/s"))
            report.add(BenchRow(f"{key}_{what}", f"{label}, {name}", rate[what], "MiB/s"))
            report.compare(f"{key}_{what}", f"{key}_{vs}")
    if cap_mib_s:
        report.add(
            BenchRow(
                "capped_move",
                f"tierd whole move, capped at {cap_mib_s:g} MiB/s",
                capped,
                "MiB/s",
                # No verdict: a small file can go in the limiter's first burst, and a slow
                # disk stays under any cap; a reader compares with the cap by eye.
                note=f"(one move, not a median; the cap: {cap_mib_s:g} MiB/s)",
            )
        )
    return report


def _root(eng: Engine, tier: str) -> Path:
    """The directory of one of the bench's (directory) tiers."""
    root = eng.tiers.get(tier).config.path
    assert root is not None
    return Path(root)
