"""Latencies of the object-store bench: 4 KiB reads, and reads served while an object streams.

- **small reads**: 4 KiB ranges at random offsets of the object, the same offsets for every
  client: tierd's ``Loader.load(offset, length)`` in this process (``small_tierd``), the same
  over REST (``GET /v1/files/{id}/content`` with ``Range``, ``small_rest``), and one boto3
  ``get_object(Range=...)`` per read (``small_boto3``, the reference). p50 and p99 in µs.
- **serving while it streams** (:func:`serving_while_streaming`): p99 of 4 KiB REST reads of
  other files (on the server's local nvme tier) at idle, then while whole-object loads from
  the s3 tier run in another thread; the busy p99 should stay within 2x of the idle one.

Every read's bytes are compared with the source's, off the clock. CPU is reported as CPU-µs
a read: this process's, plus the server's for REST paths.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._measure import percentile
from ._objrun import ObjRun, check_bytes
from ._report import BenchRow

__all__ = ["READ", "Served", "boto3_small", "rest_small", "serving_while_streaming", "tierd_small"]

READ = 4096
_WARMUP = 10
#: The longest the busy half of :func:`serving_while_streaming` gathers samples for.
BUSY_LIMIT_S = 120.0


@dataclass
class Served:
    """What the REST latencies need of a running server: its address, a client of it, and its
    pid (its CPU is read from ``/proc``)."""

    url: str
    http: Any  # httpx.Client on url, kept alive between reads
    cpu: Callable[[], float]  # CPU seconds of this process and the server


def _offsets(run: ObjRun, seed: int = 4) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(o) for o in rng.integers(0, run.size - READ + 1, size=run.samples + _WARMUP)]


def _source_slices(run: ObjRun, offsets: list[int]) -> list[bytes]:
    fd = os.open(run.source, os.O_RDONLY)
    try:
        return [os.pread(fd, READ, o) for o in offsets]
    finally:
        os.close(fd)


def _sample(
    run: ObjRun,
    what: str,
    read: Callable[[int], bytes],
    cpu_clock: Callable[[], float] = time.process_time,
) -> tuple[list[float], float]:
    """Seconds of each read at the run's offsets after a warm-up, and CPU seconds a read."""
    offsets = _offsets(run)
    expected = _source_slices(run, offsets)
    times: list[float] = []
    cpu = 0.0
    for i, (off, want) in enumerate(zip(offsets, expected, strict=True)):
        c0, t0 = cpu_clock(), time.perf_counter()
        got = read(off)
        t, c = time.perf_counter() - t0, cpu_clock() - c0
        if got != want:
            check_bytes(f"{what} at {off}", "other bytes", "the source's")
        if i >= _WARMUP:
            times.append(t)
            cpu += c
    return times, cpu / len(times)


def _rows(
    run: ObjRun, key: str, label: str, times: list[float], cpu: float, whose: str = ""
) -> None:
    us = [t * 1e6 for t in times]
    cost = f"({cpu * 1e6:.0f} CPU-us a read{', ' + whose if whose else ''})"
    for q in (50, 99):
        note = f"({len(us)} reads) {cost}" if q == 50 else ""
        run.add(BenchRow(f"{key}_p{q}_us", f"{label}, p{q}", percentile(us, q), "us", note=note))


def tierd_small(run: ObjRun, loader: Any, fid: int) -> None:
    """4 KiB ``Loader.load`` ranges into host memory, in this process."""
    run.say(f"tierd: {run.samples} 4 KiB reads (Loader.load, in process)")

    def read(off: int) -> bytes:
        lease = loader.load(fid, offset=off, length=READ, device="cpu")
        try:
            arr = lease.buffer.array()
            return bytes(arr[lease.offset : lease.offset + lease.nbytes])
        finally:
            loader.leases.release(lease.id)

    times, cpu = _sample(run, "tierd 4 KiB load", read)
    _rows(
        run,
        "small_tierd",
        "tierd 4 KiB read from the s3 tier (Loader.load, in process)",
        times,
        cpu,
    )


def boto3_small(run: ObjRun) -> None:
    """One boto3 ``get_object(Range=...)`` a read: the reference."""
    run.say(f"boto3: {run.samples} 4 KiB get_object(Range=...)")
    client = run.origin.client(pool=2)

    def read(off: int) -> bytes:
        rng = f"bytes={off}-{off + READ - 1}"
        body = client.get_object(Bucket=run.origin.bucket, Key=run.key, Range=rng)["Body"]
        try:
            data: bytes = body.read()
        finally:
            body.close()
        return data

    times, cpu = _sample(run, "boto3 4 KiB get_object", read)
    _rows(run, "small_boto3", "boto3 get_object(Range=) of 4 KiB", times, cpu)


def _content(served: Served, fid: int, off: int, what: str) -> bytes:
    r = served.http.get(
        f"/v1/files/{fid}/content", headers={"Range": f"bytes={off}-{off + READ - 1}"}
    )
    if r.status_code != 206:
        raise RuntimeError(f"{what}: HTTP {r.status_code}: {r.text[:200]}")
    data: bytes = r.content
    return data


def rest_small(run: ObjRun, served: Served, fid: int) -> None:
    """4 KiB content ranges of the object over REST (the server reads the s3 tier)."""
    run.say(f"REST: {run.samples} 4 KiB content ranges")
    times, cpu = _sample(
        run, "REST 4 KiB range", lambda off: _content(served, fid, off, "REST 4 KiB"), served.cpu
    )
    label = "tierd 4 KiB read from the s3 tier over REST (GET content, Range)"
    _rows(run, "small_rest", label, times, cpu, "client + server")


def serving_while_streaming(
    run: ObjRun,
    served: Served,
    files: dict[int, bytes],
    load: Callable[[], Callable[[], None]],
) -> None:
    """p99 of 4 KiB REST reads of ``files`` (id → bytes, local tier) at idle, then while
    ``load()`` (a whole-object load from the s3 tier) runs again and again in another thread.
    Only reads that began and ended inside one load count as busy. ``load`` returns what
    checks the loaded bytes and releases them: that runs after the load's window closes."""
    run.say(f"serving while it streams: {run.samples} 4 KiB reads idle, then during loads")
    rng = np.random.default_rng(5)
    ids = sorted(files)

    def read_one() -> None:
        fid = ids[int(rng.integers(len(ids)))]
        data = files[fid]
        off = int(rng.integers(0, len(data) - READ + 1))
        if _content(served, fid, off, "a 4 KiB read of a local file") != data[off : off + READ]:
            check_bytes(f"4 KiB read of file {fid} at {off}", "other bytes", "the file's")

    def timed_read() -> float:
        t0 = time.perf_counter()
        read_one()
        return time.perf_counter() - t0

    for _ in range(_WARMUP):
        read_one()
    idle = [timed_read() for _ in range(run.samples)]

    state = {"gen": 0, "loading": False, "loads": 0}
    stop = threading.Event()
    failed: list[BaseException] = []

    def loads() -> None:
        try:
            while not stop.is_set():
                state["loading"] = True
                try:
                    finish = load()
                finally:
                    state["loading"] = False
                    state["gen"] += 1
                finish()
                state["loads"] += 1
        except BaseException as exc:  # handed to the measuring thread, which raises it
            failed.append(exc)

    busy: list[float] = []
    thread = threading.Thread(target=loads, name="tierd-bench-stream", daemon=True)
    deadline = time.monotonic() + BUSY_LIMIT_S
    thread.start()
    try:
        while len(busy) < run.samples and time.monotonic() < deadline and not failed:
            gen, loading = state["gen"], state["loading"]
            t = timed_read()
            if loading and state["loading"] and state["gen"] == gen:
                busy.append(t)
    finally:
        stop.set()
        thread.join()
    if failed:
        raise failed[0]
    _serve_rows(run, idle, busy, state["loads"])


def _serve_rows(run: ObjRun, idle: list[float], busy: list[float], loads: int) -> None:
    label = "4 KiB REST reads of local nvme files"
    p50, p99 = (percentile([t * 1e6 for t in idle], q) for q in (50, 99))
    run.add(
        BenchRow(
            "serve_idle_p99_us",
            f"{label} at idle, p99",
            p99,
            "us",
            note=f"(p50 {p50:.0f} us, {len(idle)} reads)",
        )
    )
    key, blabel = "serve_busy_p99_us", f"{label} while the object loads from s3, p99"
    if not busy:
        run.add(BenchRow(key, blabel, None, "us", note="no read fell inside a load"))
        return
    b50, b99 = (percentile([t * 1e6 for t in busy], q) for q in (50, 99))
    row = run.add(
        BenchRow(
            key,
            blabel,
            b99,
            "us",
            note=f"(p50 {b50:.0f} us, {len(busy)} reads during {loads} loads)",
        )
    )
    if p99 > 0:
        # Lower is better here: the target is a ceiling on the ratio, which Report.compare
        # (at least) cannot say.
        row.vs, row.ratio = "serve_idle_p99_us", b99 / p99
        row.target, row.met = "<= 2x", row.ratio <= 2.0
