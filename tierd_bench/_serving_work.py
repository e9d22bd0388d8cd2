"""The background work of ``tierd bench serving`` (:mod:`tierd_bench.serving`): what runs on the
measured server beside the clients' small requests in a busy window, each kind on threads of
the bench that stop with the window.

- ``moves``: one mover a moving file, moving it back and forth between ``ssd`` and ``nvme``
  with ``POST /v1/migrations?wait=true``, one move at a time;
- ``fills``: one filler a file of the peer's, making the server's copy of it from the peer's
  pieces again and again (:mod:`tierd_bench._serving_fills`);
- ``load``: one loader, loading the large file whole into its device back to back.

Each records the span of every piece of work it finished (``time.monotonic()`` start and end)
in :class:`Shared`, which the report sets against the windows. A failure stops the bench.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from ._serving_fills import PeerFleet, fill_once
from ._serving_load import load_once

__all__ = ["BUSY", "Setup", "Shared", "with_background"]

#: The busy phases, in the order a round runs them (each after an idle window).
BUSY = ("moves", "fills", "load")


@dataclass
class Shared:
    """What the background threads share with the measuring thread; ``stop`` also reaches the
    client processes."""

    stop: Any  # a multiprocessing Event
    failed: list[BaseException] = field(default_factory=list)
    moves: list[tuple[float, float]] = field(default_factory=list)
    loads: list[tuple[float, float]] = field(default_factory=list)
    fills: list[tuple[float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, exc: BaseException) -> None:
        """Hand ``exc`` to the measuring thread (which raises it) and stop everyone."""
        self.failed.append(exc)
        self.stop.set()


@dataclass
class Setup:
    """One run's server and what its background work acts on."""

    url: str
    pid: int
    paths: dict[int, str]  # the served files: id -> path (the clients read them to compare)
    moving: list[int]
    load_fid: int | None = None
    device: str = "cpu"
    fleet: PeerFleet | None = None  # the peer and its files, with the fills phase


def _mover_loop(
    url: str, fid: int, tiers: tuple[str, str], stop: threading.Event, shared: Shared
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


def _loader_loop(url: str, fid: int, device: str, stop: threading.Event, shared: Shared) -> None:
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


def _filler_loop(
    url: str, fleet: PeerFleet, index: int, stop: threading.Event, shared: Shared
) -> None:
    """Fill the server's copy of the peer's file ``index`` from the peer, back to back, until
    ``stop``; then check the last copy's bytes (off the window's clock)."""
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            filled = 0
            while not stop.is_set() and not shared.stop.is_set():
                span = fill_once(http, fleet, index)
                filled += 1
                with shared.lock:
                    shared.fills.append(span)
            if filled and not shared.stop.is_set():
                fleet.check_copy(http, index)
    except BaseException as exc:
        shared.fail(exc)


def _threads(
    run: Setup, phase: str, stop: threading.Event, shared: Shared
) -> list[threading.Thread]:
    """``phase``'s background threads, not started (none at idle)."""
    if phase == "moves":
        return [
            threading.Thread(
                target=_mover_loop,
                args=(run.url, fid, ("ssd", "nvme"), stop, shared),
                name=f"tierd-bench-mover-{fid}",
                daemon=True,
            )
            for fid in run.moving
        ]
    if phase == "fills" and run.fleet is not None:
        return [
            threading.Thread(
                target=_filler_loop,
                args=(run.url, run.fleet, i, stop, shared),
                name=f"tierd-bench-filler-{i}",
                daemon=True,
            )
            for i in range(len(run.fleet.files))
        ]
    if phase == "load" and run.load_fid is not None:
        return [
            threading.Thread(
                target=_loader_loop,
                args=(run.url, run.load_fid, run.device, stop, shared),
                name="tierd-bench-loader",
                daemon=True,
            )
        ]
    return []


def with_background(run: Setup, phase: str, shared: Shared, measure: Callable[[], Any]) -> Any:
    """Run ``measure`` while ``phase``'s background threads work; they finish the piece of work
    in hand after it (so none overlaps the next window) before this returns."""
    stop = threading.Event()
    threads = _threads(run, phase, stop, shared)
    for t in threads:
        t.start()
    try:
        return measure()
    finally:
        stop.set()
        for t in threads:
            t.join()
