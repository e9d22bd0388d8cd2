"""The network bench's fault run: the same distribution as the largest count's, with a serving
peer killed (``SIGKILL``) mid-transfer; how long the other hosts take to warm, and how many
bytes the origin sent (its access log), against issue 26's "at most 2x the model".

**Which host, when.** Once the job has moved a fifth of its bytes, the host (never the first,
through which the job is followed) that has served the most bytes to its peers so far
(``tierd_peer_bytes_served_total``, from its ``/metrics``) is killed: the peer whose loss costs
the others most. While no host has served a peer byte (a fleet whose hosts each read the
bucket), the one with the most bytes done is killed instead, and the report says which rule
chose it. A job over before it got that far kills nobody, and says so.

**Until when.** Every other host's task done: the killed host's task stays claimed until its
claim or the task timeout lapses, so the job is cancelled once the others are done. Their
copies are then checked byte for byte (:func:`.fleet._check`).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx

from ._fleethosts import Fleet, FleetBenchFailed, Host, forget_model, model_bytes_sent
from ._measure import format_size
from .fleet import POLL_S, _check, _new_model
from .rest import metric_total

__all__ = ["KILL_AT", "ORIGIN_FAULT_TARGET", "fault_run"]

#: The share of the job's bytes done when the peer is killed.
KILL_AT = 0.2
#: Issue 26: with a serving peer killed mid-transfer the origin sends at most 2x the model.
ORIGIN_FAULT_TARGET = 2.0
_TIMEOUT_S = 3600.0
_SERVED = "tierd_peer_bytes_served_total"


def _served(h: Host) -> float:
    """Bytes ``h`` has served its peers (0 when it cannot say)."""
    try:
        text = h.http.get("/metrics").text
    except httpx.HTTPError:
        return 0.0
    return metric_total(text, _SERVED)


def _victim(hosts: list[Host], job: dict[str, Any]) -> tuple[Host, str]:
    """The host to kill and why (see the module docstring)."""
    candidates = hosts[1:]
    served = {h.host_id: _served(h) for h in candidates}
    best = max(candidates, key=lambda h: (served[h.host_id], h.host_id))
    if served[best.host_id] > 0:
        return best, f"served its peers the most ({served[best.host_id]:.0f} bytes)"
    done = {t["host"]: t["bytes_done"] for t in job["hosts"]}
    best = max(candidates, key=lambda h: (done.get(h.host_id, 0), h.host_id))
    return best, "no host had served a peer yet: the one with the most bytes done"


def fault_run(
    fleet: Fleet, size: int, shards: int, n: int, say: Callable[[str], None]
) -> dict[str, Any]:
    """One distribution of a new model to the first ``n`` hosts (at least 2) with a serving
    peer killed mid-transfer; what happened, for the report's setup. The killed host stays
    down: this is the run's last measure."""
    log = fleet.origin.access_log
    assert log is not None  # nginx: checked by the caller
    hosts = fleet.hosts[:n]
    first = hosts[0]
    tag = f"fault-n{n}"
    say(f"fault run: {n} hosts, a new model of {format_size(size)}, a serving peer killed -9")
    model = _new_model(fleet, tag, size, shards)
    body = {"model": tag, "hosts": [h.host_id for h in hosts], "target": "nvme"}
    t0 = time.monotonic()
    job = first.ok(first.http.post("/v1/fleet/prefetch", json=body), want=202)
    url = f"/v1/fleet/jobs/{job['id']}"
    killed: Host | None = None
    why = "the job ended before it was a fifth done: nobody killed"
    progress_at_kill: float | None = None
    deadline = t0 + _TIMEOUT_S
    while True:
        job = first.ok(first.http.get(url))
        tasks = {t["host"]: t for t in job["hosts"]}
        others = [t for h, t in tasks.items() if killed is None or h != killed.host_id]
        if any(t["state"] in ("failed", "cancelled") for t in others):
            raise FleetBenchFailed(f"fault run: fleet job {job['id']} ended badly: {job}")
        if all(t["state"] == "done" for t in others):
            break
        if killed is None and job["progress"] >= KILL_AT:
            killed, why = _victim(hosts, job)
            progress_at_kill = job["progress"]
            os.kill(_pid(killed), signal.SIGKILL)
            say(f"  killed {killed.host_id} at {progress_at_kill:.0%} of the job: {why}")
        if time.monotonic() > deadline:
            raise FleetBenchFailed(f"fault run: fleet job {job['id']} still open: {job}")
        time.sleep(POLL_S)
    elapsed = time.monotonic() - t0
    if killed is not None:  # its task would wait for its claim to lapse
        first.ok(first.http.delete(url))
    survivors = [h for h in hosts if h is not killed]
    sent = model_bytes_sent(fleet, tag)
    _check(fleet, survivors, model)
    forget_model(fleet, tag)
    say(
        f"  {elapsed:.3f} s, the origin sent {sent / size:.2f}x the model; "
        f"the bytes checked on {len(survivors)} host(s)"
    )
    return {
        "hosts": n,
        "killed": killed.host_id if killed else None,
        "why": why,
        "progress_at_kill": progress_at_kill,
        "seconds": elapsed,
        "origin_bytes": sent,
    }


def _pid(h: Host) -> int:
    if h.pid <= 0:
        raise FleetBenchFailed(f"host {h.host_id}: no process id to kill")
    return h.pid
