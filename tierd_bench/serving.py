"""``tierd bench serving``: what moves between tiers and a large load cost the small requests
served meanwhile.

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

Before the clients start, the movers run alone for a window (at most 10 s): a move's time with
no client, the reference of its slowdown. Then the run alternates windows of ``duration_s``:
idle (no background work), moves (``movers`` threads each moving its own file back and forth
with ``POST /v1/migrations?wait=true``, so the moves run on the server's workers under the
policy's bandwidth cap, 256 MiB/s by default), and with ``origin``, idle again and a large load
(see :mod:`tierd_bench._serving_load`). A request counts in a window when it started and ended
inside it. Alternating windows make a drift in the host's load (other work on a shared machine)
fall on every phase alike; ``runs`` repeats the whole run on a fresh server, and the report
gives medians of the runs (see :mod:`tierd_bench._serving_report`, which also says how windows
pool). The targets are issue 43's: during moves, p99 at most 1.5x idle, rate at least 0.8x, a
move at most 1.5x its time alone; during the large load, p99 at most 3x idle. The server's CPU
and the client processes' (from ``/proc``) are reported per phase, and the host's load average
with each run, so a reader sees where the cores went.

The clients are processes because a server's clients are: threads of one process would share
its GIL, and on a small host that process, not the server, would pace them, hiding part of
what a move costs the server (issue 28: threads measured 0.75x where processes saw 0.54x).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np

from tiering.checksum import Hasher

from ._measure import MiB, format_size
from ._objrun import cpu_of
from ._report import Report
from ._serving_clients import KINDS, START_S, client_process, collect
from ._serving_load import LOAD_ORIGINS, MODEL, check_load, load_once, origin_settings
from ._serving_report import PHASES, RunResult, Window, build_report
from .rest import server_process

__all__ = ["KINDS", "LOAD_ORIGINS", "PHASES", "run"]

_SERVE_FILES, _SERVE_SIZE = 4, 4 * MiB
_WARMUP_S = 1.0  # connections, pools and first leases, before the first window
_SETTLE_S = 0.5  # after the background work stops, before the next window: the last fsyncs land
_LOADS_ALONE = 3  # large loads timed with no client, the reference of their slowdown
_ALONE_S = 10.0  # at most, the movers' window with no client (dozens of moves)


@dataclass
class _Shared:
    """What the background threads share with the measuring thread; ``stop`` also reaches the
    client processes."""

    stop: Any  # a multiprocessing Event
    failed: list[BaseException] = field(default_factory=list)
    moves: list[tuple[float, float]] = field(default_factory=list)
    loads: list[tuple[float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, exc: BaseException) -> None:
        """Hand ``exc`` to the measuring thread (which raises it) and stop everyone."""
        self.failed.append(exc)
        self.stop.set()


@dataclass
class _Setup:
    """One run's server and what its background work acts on."""

    url: str
    pid: int
    paths: dict[int, str]  # the served files: id -> path (the clients read them to compare)
    moving: list[int]
    load_fid: int | None = None
    device: str = "cpu"


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
                t0 = time.monotonic()
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
                    shared.moves.append((t0, time.monotonic()))
    except BaseException as exc:
        shared.fail(exc)


def _loader_loop(url: str, fid: int, device: str, stop: threading.Event, shared: _Shared) -> None:
    """Load file ``fid`` whole into ``device`` back to back until ``stop``."""
    from tierd_client import Client  # the client is its own package; only this phase needs it

    try:
        with Client(url, timeout=600) as api:
            while not stop.is_set() and not shared.stop.is_set():
                t0 = time.monotonic()
                load_once(api, fid, device)
                with shared.lock:
                    shared.loads.append((t0, time.monotonic()))
    except BaseException as exc:
        shared.fail(exc)


def run(
    duration_s: float = 5.0,
    *,
    repeats: int = 4,
    runs: int = 1,
    clients: int = 16,
    movers: int = 2,
    move_size: int = 24 * MiB,
    cap_mib_s: float | None | Literal["policy"] = "policy",
    origin: str | None = None,
    load_size: int = 256 * MiB,
    device: str = "cpu",
    directory: Path | None = None,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Measure requests from ``clients`` processes at idle, while ``movers`` files of
    ``move_size`` bytes move between tiers and, with ``origin`` (one of
    :data:`LOAD_ORIGINS`), while a file of ``load_size`` bytes on it loads into ``device``:
    ``repeats`` rounds of windows of ``duration_s``, ``runs`` times on a fresh server.

    ``cap_mib_s``: the policy's bandwidth cap on moves, MiB/s; None for no cap, ``"policy"``
    (the default) keeps the policy's default. The data dir goes under ``directory`` (default:
    the system's temporary directory).
    """
    if duration_s <= 0 or min(repeats, runs, clients, movers, move_size, load_size) < 1:
        raise ValueError("duration, repeats, runs, clients, movers and sizes must be positive")
    if origin is not None and origin not in LOAD_ORIGINS:
        raise ValueError(f"origin must be one of {', '.join(LOAD_ORIGINS)}")
    setup: dict[str, Any] = {
        "duration_s": duration_s,
        "repeats": repeats,
        "clients": clients,
        "movers": movers,
        "move_size_bytes": move_size,
        "serve_files": _SERVE_FILES,
        "serve_file_bytes": _SERVE_SIZE,
        "kinds": [k[0] for k in KINDS],
        "runs": [],
    }
    if origin is not None:
        setup["load"] = {"origin": origin, "size_bytes": load_size, "device": device}
    results = []
    for r in range(runs):
        if runs > 1:
            say(f"run {r + 1} of {runs}")
        loadavg0 = os.getloadavg()[0]
        res, windows_doc = _one_run(setup, cap_mib_s, directory, say)
        res.loadavg = (loadavg0, os.getloadavg()[0])
        setup["runs"].append({"loadavg_1m": list(res.loadavg), "windows": windows_doc})
        results.append(res)
    return build_report(setup, results)


def _one_run(
    setup: dict[str, Any],
    cap_mib_s: float | None | Literal["policy"],
    directory: Path | None,
    say: Callable[[str], None],
) -> tuple[RunResult, list[dict[str, Any]]]:
    rng = np.random.default_rng(11)
    serve = [rng.integers(0, 256, _SERVE_SIZE, dtype=np.uint8) for _ in range(_SERVE_FILES)]
    movers, move_size = setup["movers"], setup["move_size_bytes"]
    load = setup.get("load")
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
        with contextlib.ExitStack() as stack:
            env = {"TIERD_WATCH": "true"}  # the watcher on, as `tierd serve` runs
            want = None
            if load is not None:
                more, want = stack.enter_context(
                    origin_settings(load["origin"], data, load["size_bytes"], say)
                )
                env |= more
            url, pid = stack.enter_context(server_process(data, env=env))
            with httpx.Client(base_url=url, timeout=60) as http:
                paths = {
                    _file_id(http, f"serve/f{i}.bin"): str(data / "nvme" / "serve" / f"f{i}.bin")
                    for i in range(_SERVE_FILES)
                }
                moving = {_file_id(http, f"move/m{j}.bin"): sums[j] for j in range(movers)}
                setup["cap_bytes_per_s"] = _set_policy(http, cap_mib_s, movers)
                run = _Setup(url, pid, paths, list(moving))
                if load is not None:
                    run.load_fid, run.device = _file_id(http, MODEL), load["device"]
            res = _measure(run, setup, want, say)
            with httpx.Client(base_url=url, timeout=60) as http:
                _check_moved(http, moving)
    doc = [
        {
            "phase": w.phase,
            "busy": w.phase != "idle",
            "seconds": w.t1 - w.t0,
            "requests_per_s": w.rate,
            "moves": sum(1 for a, b in res.moves if w.t0 <= a and b <= w.t1),
            "loads": sum(1 for a, b in res.loads if w.t0 <= a and b <= w.t1),
            "server_cpu_s": w.server_cpu,
            "client_cpu_s": w.client_cpu,
        }
        for w in res.windows
    ]
    return res, doc


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


def _alone(run: _Setup, setup: dict[str, Any], want: str | None, shared: _Shared) -> RunResult:
    """The background work with no client: the movers for one window, then a few large loads
    (the first one's bytes checked). Their times are the references of their slowdowns."""
    res = RunResult([], [])
    alone_s = min(setup["duration_s"], _ALONE_S)
    _with_background(run, "moves", shared, lambda: shared.stop.wait(alone_s))
    res.alone, shared.moves = shared.moves, []
    if run.load_fid is not None and want is not None:
        from tierd_client import Client

        with Client(run.url, timeout=600) as api:
            for _ in range(_LOADS_ALONE):
                t0 = time.monotonic()
                seconds = check_load(api, run.load_fid, run.device, want)
                res.loads_alone.append((t0, t0 + seconds))
    return res


def _measure(
    run: _Setup, setup: dict[str, Any], want: str | None, say: Callable[[str], None]
) -> RunResult:
    # Processes (see the module docstring). spawn, not fork: a forked child would share this
    # process's connections and threads.
    ctx = multiprocessing.get_context("spawn")
    shared = _Shared(ctx.Event())
    clients, duration_s = setup["clients"], setup["duration_s"]
    say(f"{len(run.moving)} files moving with no client, {min(duration_s, _ALONE_S):g} s")
    res = _alone(run, setup, want, shared)
    ready, done, out = ctx.Barrier(clients + 1), ctx.Array("q", clients, lock=False), ctx.Queue()
    procs = [
        ctx.Process(
            target=client_process,
            args=(run.url, run.paths, c, ready, shared.stop, done, out),
            name=f"tierd-bench-client-{c}",
            daemon=True,
        )
        for c in range(clients)
    ]

    def clients_cpu() -> float:
        return sum(cpu_of(p.pid) for p in procs if p.pid is not None)

    def window(phase: str) -> Window:
        w = Window(phase, time.monotonic(), server_cpu=cpu_of(run.pid), client_cpu=clients_cpu())
        requests0 = sum(done)
        shared.stop.wait(duration_s)
        w.t1 = time.monotonic()
        w.server_cpu = cpu_of(run.pid) - w.server_cpu
        w.client_cpu = clients_cpu() - w.client_cpu
        w.requests = sum(done) - requests0
        res.windows.append(w)
        return w

    phases = ["idle", "moves"] + (["idle", "load"] if run.load_fid is not None else [])
    say(
        f"{clients} client processes: {setup['repeats']} x ({', '.join(phases)}), "
        f"{duration_s:g} s each"
    )
    for p in procs:
        p.start()
    try:
        try:
            ready.wait(timeout=START_S)
        except threading.BrokenBarrierError:
            # A client failed (its error comes first, from _collect) or never started.
            shared.fail(RuntimeError(f"the clients did not all start in {START_S:g} s"))
        shared.stop.wait(_WARMUP_S)
        for r in range(setup["repeats"]):
            line = []
            for phase in phases:
                if shared.stop.is_set():
                    break
                w = _with_background(run, phase, shared, partial(window, phase))
                line.append(f"{phase} {w.rate:.0f} req/s")
                if phase != "idle":
                    shared.stop.wait(_SETTLE_S)
            say(f"  round {r + 1}: {', '.join(line)}")
    finally:
        shared.stop.set()
        res.samples, errors = collect(procs, out)
        shared.failed[:0] = errors  # a client's error first: it is why the others stopped
    if shared.failed:
        raise shared.failed[0]
    res.moves, res.loads = shared.moves, shared.loads
    return res


def _with_background(run: _Setup, phase: str, shared: _Shared, measure: Callable[[], Any]) -> Any:
    """Run ``measure`` while ``phase``'s background threads work: one mover a moving file, or
    the loader (none at idle)."""
    stop = threading.Event()
    threads: list[threading.Thread] = []
    if phase == "moves":
        threads = [
            threading.Thread(
                target=_mover_loop,
                args=(run.url, fid, ("ssd", "nvme"), stop, shared),
                name=f"tierd-bench-mover-{fid}",
                daemon=True,
            )
            for fid in run.moving
        ]
    elif phase == "load" and run.load_fid is not None:
        threads = [
            threading.Thread(
                target=_loader_loop,
                args=(run.url, run.load_fid, run.device, stop, shared),
                name="tierd-bench-loader",
                daemon=True,
            )
        ]
    for t in threads:
        t.start()
    try:
        return measure()
    finally:
        stop.set()
        for t in threads:
            t.join()
