"""``tierd bench serving``: what moves between tiers cost the requests served meanwhile.

Starts the service (uvicorn, its own process, the embedded default's tiers and its file
watcher, under a temporary data dir) holding small files on ``nvme`` that clients read, and
files of ``move_size`` (24 MiB) that movers carry between ``ssd`` and ``nvme``. ``clients``
processes (spawned; each with its own connections) send requests back to back, the three kinds
in turn:

- ``read_4k``: ``GET /v1/files/{id}/content`` with a 4 KiB ``Range``;
- ``load_4k`` and ``load_1m``: ``POST /v1/load`` of 4 KiB or 1 MiB into ``cpu`` (shared
  memory) through :mod:`tierd_client`, the buffer opened by the client and read, then released
  (``DELETE /v1/buffers/{id}``): one request of this kind is the load and its release.

Every reply's bytes are compared with the file's, off the clock, and the moved files' bytes
are checked at the end: a wrong byte or a failed request stops the bench, never a figure.

The run alternates windows of ``duration_s``: idle (no move), then busy (``movers`` threads
each moving its own file back and forth with ``POST /v1/migrations?wait=true``, so the moves
run on the server's workers under the policy's bandwidth cap, 256 MiB/s by default). A request
counts in a window when it started and ended inside it; a window's rate counts the requests
completed in it. Latencies (p50, p99) pool the requests of every window of a phase, as one
window holds too few for a steady p99; the request rate is the median of the windows, and its
ratio the median of each busy window's rate over the idle window just before it. Alternating
windows make a drift in the host's load (other work on a shared machine) fall on both phases
alike. The ratios carry the targets of issue 11: p99 at most 1.5x idle, rate at least 0.8x.
The server's CPU and the client processes' (from ``/proc``) are reported per phase, so a reader
sees where the cores went.

The clients are processes because a server's clients are: threads of one process would share
its GIL, and on a small host that process, not the server, would pace them, hiding part of
what a move costs the server (issue 28: threads measured 0.75x where processes saw 0.54x).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np

from tiering.checksum import Hasher

from ._measure import MiB, format_size, percentile
from ._objrun import cpu_of
from ._report import BenchRow, Report
from ._serving_clients import KINDS, START_S, Sample, client_process, collect
from .rest import server_process

__all__ = ["KINDS", "run"]

#: Targets of issue 11: busy p99 over idle p99 at most, busy rate over idle rate at least.
P99_AT_MOST, RATE_AT_LEAST = 1.5, 0.8
_SERVE_FILES, _SERVE_SIZE = 4, 4 * MiB
_WARMUP_S = 1.0  # connections, pools and first leases, before the first window
_SETTLE_S = 0.5  # after the movers stop, before the next idle window: the last fsyncs land


@dataclass
class _Window:
    busy: bool
    t0: float
    t1: float = 0.0
    server_cpu: float = 0.0
    client_cpu: float = 0.0
    moves: int = 0
    requests: int = 0  # completed, from the clients' counters (the progress line's figure)

    @property
    def rate(self) -> float:
        return self.requests / (self.t1 - self.t0)


@dataclass
class _Shared:
    """What the mover threads share with the measuring thread; ``stop`` also reaches the
    client processes."""

    stop: Any  # a multiprocessing Event
    failed: list[BaseException] = field(default_factory=list)
    moves: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, exc: BaseException) -> None:
        """Hand ``exc`` to the measuring thread (which raises it) and stop everyone."""
        self.failed.append(exc)
        self.stop.set()


def _write(path: Path, data: bytes) -> str:
    """``data`` at ``path``, fsynced; returns its checksum."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    h = Hasher()
    h.update(data)
    return h.value()


def _file_id(http: httpx.Client, relpath: str) -> int:
    r = http.get("/v1/files/lookup", params={"path": relpath})
    r.raise_for_status()
    return int(r.json()["id"])


def _mover_loop(
    url: str, fid: int, tiers: tuple[str, str], stop: threading.Event, shared: _Shared
) -> None:
    """Move file ``fid`` back and forth between ``tiers`` until ``stop``, one move at a time."""
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            where = http.get(f"/v1/files/{fid}").json()["tier"]
            while not stop.is_set() and not shared.stop.is_set():
                to = tiers[1] if where == tiers[0] else tiers[0]
                body = {"file_id": fid, "to_tier": to}
                r = http.post("/v1/migrations", params={"wait": "true"}, json=body)
                if r.status_code != 200:
                    raise RuntimeError(
                        f"move of file {fid} to {to}: HTTP {r.status_code}: {r.text}"
                    )
                (mig,) = r.json()["migrations"]
                if mig["state"] != "done":
                    raise RuntimeError(f"move of file {fid} to {to} ended {mig['state']}: {mig}")
                where = to
                with shared.lock:
                    shared.moves += 1
    except BaseException as exc:
        shared.fail(exc)


def run(
    duration_s: float = 5.0,
    *,
    repeats: int = 4,
    clients: int = 16,
    movers: int = 2,
    move_size: int = 24 * MiB,
    cap_mib_s: float | None | Literal["policy"] = "policy",
    directory: Path | None = None,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Measure requests from ``clients`` processes at idle and while ``movers`` files of
    ``move_size`` bytes move between tiers, in ``repeats`` pairs of windows of ``duration_s``.

    ``cap_mib_s``: the policy's bandwidth cap on moves, MiB/s; None for no cap, ``"policy"``
    (the default) keeps the policy's default. The data dir goes under ``directory`` (default:
    the system's temporary directory).
    """
    if duration_s <= 0 or repeats < 1 or clients < 1 or movers < 1 or move_size < 1:
        raise ValueError("duration, repeats, clients, movers and move size must be positive")
    rng = np.random.default_rng(11)
    serve = [rng.integers(0, 256, _SERVE_SIZE, dtype=np.uint8) for _ in range(_SERVE_FILES)]
    setup: dict[str, Any] = {
        "duration_s": duration_s,
        "repeats": repeats,
        "clients": clients,
        "movers": movers,
        "move_size_bytes": move_size,
        "serve_files": _SERVE_FILES,
        "serve_file_bytes": _SERVE_SIZE,
        "kinds": [k[0] for k in KINDS],
    }
    with tempfile.TemporaryDirectory(prefix="tierd-bench-", dir=directory) as tmp:
        data = Path(tmp) / "data"
        setup["data_dir"] = str(data)
        say(
            f"writing {_SERVE_FILES} files of {format_size(_SERVE_SIZE)} and {movers} of "
            f"{format_size(move_size)} under {data}; starting tierd"
        )
        for i, arr in enumerate(serve):
            _write(data / "nvme" / "serve" / f"f{i}.bin", arr.tobytes())
        sums = [
            _write(data / "ssd" / "move" / f"m{j}.bin", os.urandom(move_size))
            for j in range(movers)
        ]
        # The watcher on, as `tierd serve` runs: it sees every move's writes.
        with server_process(data, env={"TIERD_WATCH": "true"}) as (url, pid):
            with httpx.Client(base_url=url, timeout=60) as http:
                paths = {
                    _file_id(http, f"serve/f{i}.bin"): str(data / "nvme" / "serve" / f"f{i}.bin")
                    for i in range(_SERVE_FILES)
                }
                moving = {_file_id(http, f"move/m{j}.bin"): sums[j] for j in range(movers)}
                setup["cap_bytes_per_s"] = _set_policy(http, cap_mib_s, movers)
            windows, samples = _measure(
                url, pid, paths, list(moving), duration_s, repeats, clients, say
            )
            with httpx.Client(base_url=url, timeout=60) as http:
                _check_moved(http, moving)
    return _report(setup, windows, samples)


def _set_policy(
    http: httpx.Client, cap_mib_s: float | None | Literal["policy"], movers: int
) -> int | None:
    """No moves by heat (only the movers' count), room for every mover, the cap asked for;
    returns the cap in force."""
    doc = http.get("/v1/policy").json()["policy"]
    doc |= {"enabled": False, "concurrency": max(doc["concurrency"], movers)}
    if cap_mib_s != "policy":
        doc["bandwidth_bytes_per_s"] = int(cap_mib_s * MiB) if cap_mib_s else None
    r = http.put("/v1/policy", json=doc)
    r.raise_for_status()
    cap: int | None = r.json()["policy"]["bandwidth_bytes_per_s"]
    return cap


def _check_moved(http: httpx.Client, moving: dict[int, str]) -> None:
    """Each moved file's bytes, read back whole, still have the checksum they were written with."""
    for fid, want in moving.items():
        h = Hasher()
        with http.stream("GET", f"/v1/files/{fid}/content") as r:
            r.raise_for_status()
            for chunk in r.iter_bytes():
                h.update(chunk)
        if h.value() != want:
            raise AssertionError(f"moved file {fid}: the bytes differ ({h.value()} != {want})")


def _measure(
    url: str,
    pid: int,
    paths: dict[int, str],
    moving: list[int],
    duration_s: float,
    repeats: int,
    clients: int,
    say: Callable[[str], None],
) -> tuple[list[_Window], list[Sample]]:
    # Processes (see the module docstring). spawn, not fork: a forked child would share this
    # process's connections and threads.
    ctx = multiprocessing.get_context("spawn")
    shared = _Shared(ctx.Event())
    ready, done, out = ctx.Barrier(clients + 1), ctx.Array("q", clients, lock=False), ctx.Queue()
    procs = [
        ctx.Process(
            target=client_process,
            args=(url, paths, c, ready, shared.stop, done, out),
            name=f"tierd-bench-client-{c}",
            daemon=True,
        )
        for c in range(clients)
    ]
    windows: list[_Window] = []

    def clients_cpu() -> float:
        return sum(cpu_of(p.pid) for p in procs if p.pid is not None)

    def window(busy: bool) -> _Window:
        w = _Window(busy, time.monotonic(), server_cpu=cpu_of(pid), client_cpu=clients_cpu())
        moves0, requests0 = shared.moves, sum(done)
        shared.stop.wait(duration_s)
        w.t1 = time.monotonic()
        w.server_cpu = cpu_of(pid) - w.server_cpu
        w.client_cpu = clients_cpu() - w.client_cpu
        w.moves, w.requests = shared.moves - moves0, sum(done) - requests0
        windows.append(w)
        return w

    say(
        f"{clients} client processes: {repeats} x ({duration_s:g} s idle, {duration_s:g} s "
        f"while {len(moving)} files move)"
    )
    for p in procs:
        p.start()
    samples: list[Sample] = []
    try:
        try:
            ready.wait(timeout=START_S)
        except threading.BrokenBarrierError:
            # A client failed (its error comes first, from _collect) or never started.
            shared.fail(RuntimeError(f"the clients did not all start in {START_S:g} s"))
        shared.stop.wait(_WARMUP_S)
        for r in range(repeats):
            if shared.stop.is_set():
                break
            idle = window(False)
            busy = _while_moving(url, moving, shared, lambda: window(True))
            shared.stop.wait(_SETTLE_S)
            say(
                f"  pair {r + 1}: idle {idle.rate:.0f} req/s, "
                f"during {busy.moves} moves {busy.rate:.0f} req/s"
            )
    finally:
        shared.stop.set()
        samples, errors = collect(procs, out)
        shared.failed[:0] = errors  # a client's error first: it is why the others stopped
    if shared.failed:
        raise shared.failed[0]
    return windows, samples


def _while_moving(
    url: str, moving: list[int], shared: _Shared, measure: Callable[[], _Window]
) -> _Window:
    """Run ``measure`` while one mover thread a file keeps moving ``moving``."""
    stop_moving = threading.Event()
    movers = [
        threading.Thread(
            target=_mover_loop,
            args=(url, fid, ("ssd", "nvme"), stop_moving, shared),
            name=f"tierd-bench-mover-{fid}",
            daemon=True,
        )
        for fid in moving
    ]
    for m in movers:
        m.start()
    try:
        return measure()
    finally:
        stop_moving.set()
        for m in movers:
            m.join()


def _inside(w: _Window, samples: list[Sample]) -> list[Sample]:
    return [s for s in samples if s.t0 >= w.t0 and s.t1 <= w.t1]


def _rate_of(w: _Window, samples: list[Sample]) -> float:
    return sum(1 for s in samples if w.t0 <= s.t1 < w.t1) / (w.t1 - w.t0)


def _label(phase: str) -> str:
    return "idle" if phase == "idle" else "while files move"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _report(setup: dict[str, Any], windows: list[_Window], samples: list[Sample]) -> Report:
    cap = setup.get("cap_bytes_per_s")
    report = Report(
        "serving",
        f"tierd bench serving: {setup['clients']} client processes over REST, idle vs while "
        f"{setup['movers']} files of {format_size(setup['move_size_bytes'])} move between "
        f"tiers ({f'capped at {cap / MiB:g} MiB/s' if cap else 'no cap'}); "
        f"{setup['repeats']} pairs of {setup['duration_s']:g} s windows",
        setup,
    )
    phases = {"idle": [w for w in windows if not w.busy], "busy": [w for w in windows if w.busy]}
    rates = {phase: [_rate_of(w, samples) for w in ws] for phase, ws in phases.items()}
    setup["windows"] = [
        {
            "busy": w.busy,
            "seconds": w.t1 - w.t0,
            "requests_per_s": _rate_of(w, samples),
            "moves": w.moves,
            "server_cpu_s": w.server_cpu,
            "client_cpu_s": w.client_cpu,
        }
        for w in windows
    ]
    pooled = {phase: [s for w in ws for s in _inside(w, samples)] for phase, ws in phases.items()}
    for k, name in ((None, "all"), *((k, kind[0]) for k, kind in enumerate(KINDS))):
        for phase, got in pooled.items():
            ms = [s.seconds * 1e3 for s in got if k is None or s.kind == k]
            report.add(
                BenchRow(
                    f"{name}_p99_{phase}_ms",
                    f"{'every request' if k is None else name}, p99, {_label(phase)}",
                    percentile(ms, 99) if ms else None,
                    "ms",
                    note=f"(p50 {percentile(ms, 50):.2f} ms, {len(ms)} requests)"
                    if ms
                    else "no requests",
                )
            )
        report.compare(f"{name}_p99_busy_ms", f"{name}_p99_idle_ms", at_most=P99_AT_MOST)
    for phase, values in rates.items():
        report.add(
            BenchRow(
                f"rate_{phase}",
                f"requests completed per second, {_label(phase)}",
                _median(values),
                "req/s",
                note=f"(median of {len(values)} windows)",
            )
        )
    pairs = [b / a for a, b in zip(rates["idle"], rates["busy"], strict=False) if a > 0]
    row = report.rows["rate_busy"]
    if pairs and row.value is not None:
        # Each busy window over the idle one before it (see the module docstring).
        row.vs, row.ratio = "rate_idle", statistics.median(pairs)
        row.target, row.met = f">= {RATE_AT_LEAST:g}x", row.ratio >= RATE_AT_LEAST
        row.note = f"(median of {len(pairs)} windows; the ratio: median of the pairs')"
    for phase, ws in phases.items():
        clients = _median([w.client_cpu / (w.t1 - w.t0) for w in ws])
        report.add(
            BenchRow(
                f"server_cpu_{phase}",
                f"server CPU, {_label(phase)}",
                _median([w.server_cpu / (w.t1 - w.t0) for w in ws]),
                "cores",
                note=f"(the client processes: {clients:.2f} cores)" if clients else "",
            )
        )
    busy = phases["busy"]
    report.add(
        BenchRow(
            "moved_mib_s",
            "bytes moved while serving",
            _median([w.moves * setup["move_size_bytes"] / MiB / (w.t1 - w.t0) for w in busy]),
            "MiB/s",
            note=f"({sum(w.moves for w in busy)} moves in {len(busy)} windows)",
        )
    )
    return report
