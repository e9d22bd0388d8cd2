"""The object-store bench over REST: a real tierd server, and this process as its client.

The server (uvicorn, its own process, :func:`.rest.server_process`) gets two tiers: ``nvme``,
a directory holding a few small files, and ``s3``, the run's prefix on the origin, so the scan
at start adopts the object in place. Its policy is switched off first (heat from the reads
below must not promote the object off the s3 tier). Then, from this process:

- ``rest_tierd_<dev>``: ``POST /v1/load`` of the whole object into each device, until it is
  usable here (a torch tensor on ``cuda:N`` through CUDA IPC, a NumPy array over the shared
  memory on ``cpu``), bytes checked; against the in-process load of the same device.
- ``small_rest``: 4 KiB content ranges (:func:`._objlatency.rest_small`);
- ``serve_*``: 4 KiB reads of the nvme files at idle and while the object streams
  (:func:`._objlatency.serving_while_streaming`).

CPU-s/GB of a REST row counts this process and the server (``/proc/<pid>/stat``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from . import _objlatency
from ._measure import GiB, MiB, free_gpu
from ._objlatency import Served
from ._objrun import ObjRun, checksum_of_array, cpu_of
from ._origin import REGION
from .rest import materialiser, server_process

__all__ = ["SERVE_FILES", "rest_measures"]

#: Small files on the server's nvme tier that the "serving while it streams" reads hit.
SERVE_FILES, _SERVE_SIZE = 8, 1 * MiB
_MODEL = "model.bin"


def rest_measures(run: ObjRun, devices: list[str]) -> None:
    """Every REST figure, ``devices`` in order (the first is the one that streams while the
    local files are read). A server that cannot start or serve gives rows saying why."""
    run.say("REST: starting tierd (an nvme directory tier, and the s3 tier on the origin)")
    try:
        with _tierd_server(run) as (served, api, fid, files):
            for device in devices:
                _rest_load(run.on(device), api, fid, served)
                free_gpu()
            _objlatency.rest_small(run.on("cpu"), served, fid)
            on = run.on(devices[0])
            _objlatency.serving_while_streaming(on, served, files, _streamer(on, api, fid))
    except AssertionError:
        raise  # wrong bytes stop the bench
    except Exception as exc:
        why = f"failed: {type(exc).__name__}: {exc}"
        for key, label in _rest_rows(run, devices):
            if key not in run.report.rows:
                run.missing(key, label, why, "GB/s" if key.startswith("rest_") else "us")


def _rest_rows(run: ObjRun, devices: list[str]) -> list[tuple[str, str]]:
    rows = [(f"rest_tierd_{run.on(d).dev}", _label(d)) for d in devices]
    rows += [(f"small_rest_p{q}_us", f"tierd 4 KiB read over REST, p{q}") for q in (50, 99)]
    rows += [
        (f"serve_{w}_p99_us", f"4 KiB REST reads of local files, {w}, p99")
        for w in ("idle", "busy")
    ]
    return rows


def _label(device: str) -> str:
    return f"tierd REST load -> {device}, into this (second) process"


@contextlib.contextmanager
def _tierd_server(run: ObjRun) -> Iterator[tuple[Served, Any, int, dict[int, bytes]]]:
    """The server on the run's origin: (served, a tierd_client Client, the object's file id,
    the nvme files' ids and bytes)."""
    import httpx

    # The client is its own package: imported here, as only the REST figures need it.
    from tierd_client import Client

    base = run.work / f"rest-{secrets.token_hex(4)}"
    local = _write_serve_files(base / "nvme" / "serve")
    try:
        with (
            server_process(base, env=_settings(run, base)) as (url, pid),
            Client(url, timeout=600) as api,
            httpx.Client(base_url=url, timeout=60) as http,
        ):
            doc = api.policy()["policy"]
            api.request("PUT", "/v1/policy", json=doc | {"enabled": False})
            rec = api.file(_MODEL)
            if rec["tier"] != "s3":
                raise RuntimeError(f"{_MODEL} was adopted on tier {rec['tier']!r}, not s3")
            files = {int(api.file(f"serve/{n}")["id"]): data for n, data in local.items()}
            served = Served(url, http, lambda: time.process_time() + cpu_of(pid))
            yield served, api, int(rec["id"]), files
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _settings(run: ObjRun, base: Path) -> dict[str, str]:
    org = run.origin
    s3: dict[str, Any] = {
        "name": "s3",
        "url": f"s3://{org.bucket}/{run.prefix}",
        "endpoint_url": org.endpoint,
    }
    if org.kind != "url":  # a URL's region comes from the AWS chain, as in-process
        s3["region"] = REGION
    if run.connections is not None:
        s3["connections"] = run.connections
    tiers = [{"name": "nvme", "path": str(base / "nvme")}, s3]
    return {
        "TIERD_TIERS": json.dumps(tiers),
        "TIERD_BUFFERS__CPU_BUDGET_BYTES": str(max(4 * GiB, 2 * run.size)),
        "TIERD_LOG_LEVEL": "warning",
    }


def _write_serve_files(where: Path) -> dict[str, bytes]:
    where.mkdir(parents=True)
    rng = np.random.default_rng(6)
    files = {}
    for i in range(SERVE_FILES):
        data = rng.integers(0, 256, _SERVE_SIZE, dtype=np.uint8).tobytes()
        (where / f"f{i}.bin").write_bytes(data)
        files[f"f{i}.bin"] = data
    return files


def _checksum(run: ObjRun, buf: Any) -> str:
    if run.cuda:
        return checksum_of_array(importlib.import_module("cupy").asarray(buf))
    return checksum_of_array(np.asarray(buf))


def _rest_load(run: ObjRun, api: Any, fid: int, served: Served) -> None:
    materialise = materialiser(run.device)
    paths: set[str] = set()

    def load() -> list[Any]:
        b = api.load(fid, device=run.device)
        return [b, materialise(b)]

    def check(held: list[Any]) -> None:
        b = held[0]
        try:
            paths.add(f"{b.info.get('io_path')}")
            run.check("REST load", _checksum(run, b))
        finally:
            held.clear()  # the tensor or array view goes before the mapping it views
            b.close()

    t, cpu = run.timed(load, check, cpu_clock=served.cpu)
    note = f"(server io path: {', '.join(sorted(paths))})"
    run.rate_row(f"rest_tierd_{run.dev}", _label(run.device), t, cpu, note, whose="client + server")


def _streamer(run: ObjRun, api: Any, fid: int) -> Callable[[], Callable[[], None]]:
    """One whole-object REST load into ``run.device``; returns what checks and releases it."""

    def load() -> Callable[[], None]:
        b = api.load(fid, device=run.device)

        def finish() -> None:
            try:
                run.check("REST load while serving", _checksum(run, b))
            finally:
                b.close()

        return finish

    return load
