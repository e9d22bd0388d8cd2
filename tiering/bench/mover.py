"""Benchmark of the migration copy path against ``cp`` across two filesystems.

``python -m tiering.bench.mover --size 256 --src /tmp --dst /dev/shm`` writes a file of
``--size`` MiB under ``--src``, then, from a warm page cache and in both directions, times:

- ``cp`` + ``sync FILE`` (an fsync of the copy) against tierd's copy path (claim to publish:
  copy and xxh3 hash in one pass, fsync, verify, no-clobber publish, directory fsync);
- ``cp`` + ``sync`` + ``rm`` of the source (what a careful ``mv`` does) against the whole
  migration (the above plus the catalog switch, source unlink and directory fsync);
- one more migration under a bandwidth cap (``--cap`` MiB/s).

It prints MiB/s and the ratios to ``cp``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from tiering.config import EngineConfig, TierConfig
from tiering.engine import Engine

__all__ = ["run"]

MIB = 1 << 20


def _fill(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        block = os.urandom(4 * MIB)
        left = size
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())


def run(
    size_mib: int, src: Path, dst: Path, repeats: int = 3, cap_mib_s: float | None = 100.0
) -> dict[str, float]:
    """Time ``cp``+fsync and tierd migrations of one ``size_mib`` file from ``src`` to ``dst``."""
    size = size_mib * MIB
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
                    src_file = eng.tiers.get(here).root / "f.bin"
                    tmp = eng.tiers.get(here).root / "cp-src.bin"
                    os.link(src_file, tmp)  # a second name, so rm frees nothing tierd needs
                    dst_file = eng.tiers.get(there).root / "cp.bin"
                    t0 = time.perf_counter()
                    subprocess.run(["cp", str(tmp), str(dst_file)], check=True)
                    subprocess.run(["sync", str(dst_file)], check=True)
                    t1 = time.perf_counter()
                    os.unlink(tmp)
                    t[key]["cp"].append(t1 - t0)
                    os.unlink(dst_file)
                    # cp + rm of a file whose last name goes (the data is freed, as in a move)
                    scratch = eng.tiers.get(here).root / "scratch.bin"
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
            capped = float("nan")
            if cap_mib_s:
                eng.set_policy(
                    eng.policy().document() | {"bandwidth_bytes_per_s": int(cap_mib_s * MIB)}
                )
                t0 = time.perf_counter()
                eng.migrate(fid, "b" if eng.get(fid).tier == "a" else "a")
                capped = size / MIB / (time.perf_counter() - t0)
        finally:
            eng.stop()
        out: dict[str, float] = {"size_mib": size_mib}
        for key, ts in t.items():
            rate = {k: size / MIB / statistics.median(v) for k, v in ts.items()}
            out[f"{key} cp+sync MiB/s"] = round(rate["cp"], 1)
            out[f"{key} tierd copy path MiB/s"] = round(rate["copy"], 1)
            out[f"{key} copy ratio"] = round(rate["copy"] / rate["cp"], 3)
            out[f"{key} cp+sync+rm MiB/s"] = round(rate["cp_rm"], 1)
            out[f"{key} tierd full move MiB/s"] = round(rate["move"], 1)
            out[f"{key} move ratio"] = round(rate["move"] / rate["cp_rm"], 3)
        out["capped_mib_s"] = round(capped, 1)
        out["cap_mib_s"] = cap_mib_s or 0.0
        return out
    finally:
        shutil.rmtree(a, ignore_errors=True)
        shutil.rmtree(b, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=256, help="file size in MiB")
    p.add_argument("--src", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--dst", type=Path, default=Path("/dev/shm"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cap", type=float, default=100.0, help="bandwidth cap to test, MiB/s")
    args = p.parse_args()
    print(json.dumps(run(args.size, args.src, args.dst, args.repeats, args.cap)))


if __name__ == "__main__":
    main()
