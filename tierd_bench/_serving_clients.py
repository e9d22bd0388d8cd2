"""The clients of ``tierd bench serving`` (:mod:`tierd_bench.serving`): each one a process of
its own, spawned, as a server's clients are. Threads of one process would share its GIL, and
on a small host that process, not the server, would pace them."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from ._measure import MiB

__all__ = ["KINDS", "START_S", "Sample", "client_process", "collect"]

#: Request kinds: (name, bytes read, whether it is a load into ``cpu``).
KINDS: tuple[tuple[str, int, bool], ...] = (
    ("read_4k", 4096, False),
    ("load_4k", 4096, True),
    ("load_1m", MiB, True),
)
START_S = 120.0  # at most, for the client processes to start (imports on a busy host)


@dataclass
class Sample:
    kind: int  # index in KINDS
    t0: float  # time.monotonic(): one clock for every process of the host
    t1: float
    seconds: float  # t1 - t0 less the time spent checking the bytes


def client_process(
    url: str, paths: dict[int, str], seed: int, ready: Any, stop: Any, done: Any, out: Any
) -> None:
    """One client, a process of its own: requests back to back, the kinds in turn, from the
    barrier ``ready`` until ``stop``; counts them in ``done[seed]`` and puts its samples (or
    its failure) on ``out``."""
    try:
        # The expected bytes, read before the server is asked for anything.
        files = {fid: np.fromfile(path, dtype=np.uint8) for fid, path in paths.items()}
        samples = _client_loop(url, files, seed, ready, stop, done)
    except BaseException as exc:
        import traceback

        ready.abort()  # the others, and the bench, would wait at the barrier for ever
        stop.set()
        out.put((seed, isinstance(exc, AssertionError), traceback.format_exc()))
    else:
        out.put((seed, None, samples))


def _client_loop(
    url: str, files: dict[int, np.ndarray], seed: int, ready: Any, stop: Any, done: Any
) -> list[Sample]:
    from tierd_client import Client  # the client is its own package; only this bench needs it

    rng = np.random.default_rng(seed)
    ids = sorted(files)
    samples: list[Sample] = []
    # Reads as a plain HTTP client sends them; loads through tierd's client, which opens
    # the shared memory and releases the lease as an inference process would.
    with Client(url, timeout=60) as api, httpx.Client(base_url=url, timeout=60) as http:
        ready.wait(timeout=START_S)
        i = seed  # clients start at different kinds, so every kind is in flight at once
        while not stop.is_set():
            kind = i % len(KINDS)
            i += 1
            name, length, is_load = KINDS[kind]
            fid = ids[int(rng.integers(len(ids)))]
            data = files[fid]
            off = int(rng.integers(0, (len(data) - length) // 4096 + 1)) * 4096
            want = data[off : off + length]
            t0 = time.monotonic()
            if is_load:
                with api.load(fid, offset=off, length=length, device="cpu") as buf:
                    c0 = time.monotonic()
                    ok = np.array_equal(np.asarray(buf.array), want)
                    check = time.monotonic() - c0
            else:
                r = http.get(
                    f"/v1/files/{fid}/content",
                    headers={"Range": f"bytes={off}-{off + length - 1}"},
                )
                c0 = time.monotonic()
                if r.status_code != 206:
                    raise RuntimeError(f"{name}: HTTP {r.status_code}: {r.text[:200]}")
                ok = r.content == want.tobytes()
                check = time.monotonic() - c0
            t1 = time.monotonic()
            if not ok:
                raise AssertionError(f"{name} of file {fid} at {off}: the bytes differ")
            samples.append(Sample(kind, t0, t1, t1 - t0 - check))
            done[seed] += 1
    return samples


def collect(procs: list[Any], out: Any) -> tuple[list[Sample], list[BaseException]]:
    """Every client's samples, and the clients' failures. Read before the processes are
    joined: a process exits only once what it put on ``out`` was taken."""
    samples: list[Sample] = []
    failed: list[BaseException] = []
    left = len(procs)
    while left:
        try:
            c, assertion, got = out.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                codes = [p.exitcode for p in procs]
                failed.append(RuntimeError(f"a client process died: exit codes {codes}"))
                break
            continue
        left -= 1
        if assertion is None:
            samples.extend(got)
        else:
            kind = AssertionError if assertion else RuntimeError
            failed.append(kind(f"client {c} failed:\n{got}"))
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
    return samples, failed
