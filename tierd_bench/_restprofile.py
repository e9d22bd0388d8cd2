"""Where a state-dict load over REST spends its time, phase by phase, on both sides.

:meth:`tierd_client.Client.load_state_dict` on safetensors files is, in order: one
``POST /v1/load/safetensors`` (the round trip), the reply's JSON parsed, each shard's buffer
opened (a CUDA IPC handle, or a shared-memory segment, per shard), a view per tensor
(:class:`~tierd_client.Tensors`), the torch tensors and their lease keeper, the wait for the
server's copies (a load into a GPU asks for ``wait: false``, so a memory-tier load's copies
run under the steps before it), and, before the tensors are used, a synchronise.
:func:`profiled_load` takes those same steps through the client's own functions, reading the
clock between them, so its figures are the client's and nothing of the client's hot path
changes to measure it. What freeing the tensors costs
afterwards (``close``: the buffers' mappings closed) is reported beside them, not in their sum.

The server says its side in the reply's ``Server-Timing`` header (see
``app.api.loads.server_timing``): ``load`` (``open``, ``read`` with its ``alloc``, ``sync``,
``grant``) and ``reply``. What the round trip holds beyond them (``http``) is HTTP, request
validation and the event loop's hand-off to the worker thread.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._measure import device_sync
from ._report import BenchRow, Report

__all__ = [
    "CLIENT_PHASES",
    "Profile",
    "add_rows",
    "parse_server_timing",
    "profile",
    "profiled_load",
    "release",
]

#: The client's phases, in order; their sum is the whole load.
CLIENT_PHASES = ("request", "parse", "open", "views", "torch", "wait", "sync")
_CLIENT_LABELS = {
    "request": "client: POST round trip (server time included)",
    "parse": "client: reply JSON parse",
    "open": "client: open the buffers (IPC / shm), one per shard",
    "views": "client: a view per tensor (Tensors)",
    "torch": "client: torch tensors + lease keeper",
    "wait": "client: wait for the server's copies to land (ready_event)",
    "sync": "client: device synchronise",
    "close": "client, after the load: tensors freed (IPC mappings closed), not in the sum",
}
_SERVER_LABELS = {
    "load": "server: the load in all",
    "open": "server:   open the files",
    "read": "server:   headers, allocations, reads (shards at once)",
    "alloc": "server:     of which allocations (summed over shards)",
    "io": "server:     of which the slowest shard's read or copy (its IoReport)",
    "sync": "server:   device synchronise",
    "grant": "server:   leases + export handles",
    "reply": "server: reply body",
    "http": "HTTP + validation + thread hand-off (round trip - load - reply)",
}


@dataclass
class Profile:
    """Seconds of each phase over several loads (lists in load order)."""

    client: dict[str, list[float]] = field(default_factory=dict)
    server: dict[str, list[float]] = field(default_factory=dict)
    total: list[float] = field(default_factory=list)
    sources: set[str] = field(default_factory=set)

    def add(self, client: dict[str, float], server: dict[str, float]) -> None:
        for k, v in client.items():
            self.client.setdefault(k, []).append(v)
        if server:
            server = {**server, "http": client["request"] - server.get("load", 0.0)}
            server["http"] -= server.get("reply", 0.0)
        for k, v in server.items():
            self.server.setdefault(k, []).append(v)
        self.total.append(sum(client[p] for p in CLIENT_PHASES))


def parse_server_timing(header: str | None) -> dict[str, float]:
    """``{phase: seconds}`` of a ``Server-Timing`` header (``name;dur=ms, ...``)."""
    out: dict[str, float] = {}
    for item in (header or "").split(","):
        name, _, params = item.strip().partition(";")
        for p in params.split(";"):
            key, _, value = p.strip().partition("=")
            if key == "dur" and name:
                with contextlib.suppress(ValueError):
                    out[name] = float(value) / 1e3
    return out


def profiled_load(
    api: Any, paths: Sequence[str], device: str
) -> tuple[dict[str, Any], dict[str, float], dict[str, float], list[str], set[str]]:
    """One state-dict load of ``paths`` into ``device`` as the client makes it, timed by
    phase: ``(state dict, client phases, server phases, lease ids, sources)``. The caller
    releases the leases (:func:`release`) once it has checked the tensors."""
    from tierd_client._buffers import Tensors
    from tierd_client._exceptions import error_from_response
    from tierd_client._loads import parse_target, safetensors_body
    from tierd_client._state_dict import _wrap

    sync = device_sync(device)
    body = safetensors_body(list(paths), None, parse_target(device), None, False)
    t0 = time.perf_counter()
    resp = api._http.post("/v1/load/safetensors", json=body)
    t1 = time.perf_counter()
    if resp.status_code >= 400:
        raise error_from_response(resp)
    reply = resp.json()
    t2 = time.perf_counter()
    buffers = api._open_all(reply, wait=False)
    t3 = time.perf_counter()
    try:
        tensors = Tensors(buffers, reply["tensors"])
        t4 = time.perf_counter()
        state = _wrap(api, tensors)
        for b in buffers:
            b.close(release=False)  # as load_state_dict: the keeper holds the leases now
        t5 = time.perf_counter()
        tensors.wait()
        t6 = time.perf_counter()
    except BaseException:
        for b in buffers:
            b.close()
        raise
    sync()
    t7 = time.perf_counter()
    ticks = (t0, t1, t2, t3, t4, t5, t6, t7)
    client = {p: b - a for p, a, b in zip(CLIENT_PHASES, ticks[:-1], ticks[1:], strict=True)}
    server = parse_server_timing(resp.headers.get("server-timing"))
    if server:
        # The bytes' own time, from each lease's report: what the read phase is beyond it is
        # headers and allocations.
        # (None where the copies had not landed at the reply: their time is in "wait".)
        server["io"] = max((float(b.info.get("seconds") or 0) for b in buffers), default=0.0)
    sources = {str(b.source) for b in buffers}
    return state, client, server, [b.id for b in buffers], sources


def release(api: Any, ids: Sequence[str]) -> None:
    """Give the leases back now, so the next load finds their allocations in the pool (the
    keeper would release them too, but later, from its own thread)."""
    from tierd_client._exceptions import NotFound

    for lease in ids:
        with contextlib.suppress(NotFound):
            api.release(lease)


def profile(
    api: Any,
    paths: Sequence[str],
    device: str,
    repeats: int,
    check: Callable[[dict[str, Any]], None],
    warmup: int = 1,
) -> Profile:
    """``repeats`` profiled loads after ``warmup``; every load's tensors checked, untimed."""
    prof = Profile()
    for i in range(repeats + warmup):
        state, client, server, ids, sources = profiled_load(api, paths, device)
        try:
            check(state)
        finally:
            t0 = time.perf_counter()
            state.clear()  # the last views of the buffers: their mappings close here
            client["close"] = time.perf_counter() - t0
            release(api, ids)
        if i >= warmup:
            prof.add(client, server)
            prof.sources |= sources
    return prof


def add_rows(report: Report, prefix: str, title: str, prof: Profile) -> None:
    """The medians of each phase as rows ``<prefix>_<side>_<phase>`` (ms), under a header row
    ``<prefix>`` holding the median whole load (ms)."""
    note = f"(source: {', '.join(sorted(prof.sources))})"
    ms = statistics.median(prof.total) * 1e3
    report.add(BenchRow(prefix, f"profile: {title}", ms, "ms", note=note))
    for side, phases, labels in (
        ("client", prof.client, _CLIENT_LABELS),
        ("server", prof.server, _SERVER_LABELS),
    ):
        for phase, label in labels.items():
            if phase in phases:
                value = statistics.median(phases[phase]) * 1e3
                report.add(BenchRow(f"{prefix}_{side}_{phase}", f"  {label}", value, "ms"))
