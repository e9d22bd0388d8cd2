"""``tierd bench rest``: loads over REST against :mod:`tiering.io` in-process, on one host.

Starts the service (uvicorn, its own process) on a temporary data dir holding one file on the
fastest tier, and measures from this process, the client:

- **throughput**: a hot file from ``POST /v1/load`` until it is usable here (on ``cuda:N`` a
  torch tensor: CUDA IPC opened, ``torch.from_dlpack``, device synchronised; on ``cpu`` a
  NumPy array over the shared memory), against ``GpuDirectStorage.read`` of the same file in
  this process; medians of ``repeats`` after a warm-up.
- **4 KiB overhead**: the same for a 4 KiB range, p50 and p99 of ``small`` loads, minus the
  in-process 4 KiB read's p50. Releasing the lease is a second request, reported apart.
"""

from __future__ import annotations

import importlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tiering.config import TierConfig
from tiering.io import GpuDirectStorage

from ._measure import (
    default_device,
    device_sync,
    format_size,
    free_gpu,
    gbps,
    gpu_name,
    percentile,
)
from ._report import BenchRow, Report, describe_device

__all__ = ["follow_job", "materialiser", "metric_total", "run", "server_process"]

_WARMUP, _SMALL_WARMUP = 2, 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _write(path: Path, nbytes: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(nbytes >> 20):
            f.write(chunk)
        f.write(chunk[: nbytes & ((1 << 20) - 1)])


@contextmanager
def _server(data_dir: Path, timeout: float = 120) -> Iterator[str]:
    """The service on a free loopback port, serving ``data_dir``; yields its URL."""
    with server_process(data_dir, timeout=timeout) as (url, _):
        yield url


def metric_total(text: str, name: str, labels: str = "") -> float:
    """The sum of metric ``name``'s series in ``text`` (a ``/metrics`` page) whose labels hold
    ``labels`` (0 where it has none yet)."""
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric == name and labels in rest:
            total += float(value)
    return total


def follow_job(
    job: dict[str, Any],
    fetch: Callable[[], dict[str, Any]],
    *,
    poll_s: float,
    timeout_s: float,
    late: Callable[[dict[str, Any]], Exception],
) -> dict[str, Any]:
    """``job`` (a ``/v1/jobs`` or ``/v1/fleet/jobs`` document) once it is neither queued nor
    running, ``fetch`` asked for it again every ``poll_s``; ``late(job)`` is raised once
    ``timeout_s`` have passed."""
    deadline = time.monotonic() + timeout_s
    while job["state"] in ("queued", "running"):
        if time.monotonic() > deadline:
            raise late(job)
        time.sleep(poll_s)
        job = fetch()
    return job


@contextmanager
def server_process(
    data_dir: Path,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    host: str = "127.0.0.1",
    wrap: Sequence[str] = (),
) -> Iterator[tuple[str, int]]:
    """The service in its own process on a free port of ``host`` (loopback by default; started
    under the command prefix ``wrap``, such as ``ip netns exec NS``), serving ``data_dir``
    (more settings in ``env``, ``TIERD_*``); yields its URL and pid once it is ready."""
    port = _free_port()
    env = {
        **os.environ,
        "TIERD_DATA_DIR": str(data_dir),
        "TIERD_WATCH": "false",  # the file is there before start; the scan adopts it
        "TIERD_HOST": host,
        "TIERD_PORT": str(port),
        # What other hosts of a fleet reach it at (its hostname may not resolve to ``host``).
        "TIERD_ADVERTISE_URL": f"http://{host}:{port}",
        **(env or {}),
    }
    # A separate process, as in production: the client must pay for IPC, not share memory.
    cmd = [
        *wrap,
        sys.executable,
        "-m",
        "uvicorn",
        "app.main:create_app",
        "--factory",
        "--host",
        host,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--timeout-keep-alive",
        "65",  # as ``tierd serve`` (app.cli.KEEP_ALIVE_S)
    ]
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + timeout
        # One client for the polls: each new one loads the CA bundle (tens of ms of CPU), and
        # eight hosts starting at once on two cores were slowed by their own bench's polling.
        with httpx.Client(timeout=2) as http:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"tierd exited with {proc.returncode} before it was ready")
                try:
                    if http.get(f"{url}/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tierd was not ready after {timeout:g} s")
                time.sleep(0.1)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def materialiser(device: str) -> Callable[[Any], Any]:
    """What a client does with a loaded buffer before using it: a torch tensor on a GPU (and a
    synchronise), a NumPy array in host memory. Both must be views, not copies."""
    if device.startswith("cuda"):
        torch = importlib.import_module("torch")

        def to_tensor(buf: Any) -> Any:
            t = torch.from_dlpack(buf)
            torch.cuda.synchronize(device)
            assert t.data_ptr() == buf.__cuda_array_interface__["data"][0], "copied"
            return t

        return to_tensor

    def to_array(buf: Any) -> Any:
        a = np.asarray(buf)
        assert a.__array_interface__["data"][0] == buf.__array_interface__["data"][0], "copied"
        return a

    return to_array


def _in_process(
    device: str, data: Path, path: Path, size: int, repeats: int, small: int
) -> tuple[list[float], list[float], str]:
    """Seconds of whole-file and of 4 KiB reads by tiering.io here, and its I/O path."""
    sync = device_sync(device)
    tiers = [TierConfig(n, data / n) for n in ("nvme", "ssd", "hdd")]
    whole: list[float] = []
    small_s: list[float] = []
    with GpuDirectStorage(device, tiers=tiers) as gds, gds.open_file(path) as f:
        io_path = str(f.io_path)
        for i in range(repeats + _WARMUP):
            t0 = time.perf_counter()
            r = gds.read(f)
            sync()
            dt = time.perf_counter() - t0
            del r  # outside the timed part, as the client's close is below
            if i >= _WARMUP:
                whole.append(dt)
        for i in range(small + _SMALL_WARMUP):
            off = (i * 7919 % (size // 4096)) * 4096
            t0 = time.perf_counter()
            r = gds.read(f, off, 4096)
            sync()
            dt = time.perf_counter() - t0
            del r
            if i >= _SMALL_WARMUP:
                small_s.append(dt)
    free_gpu()
    return whole, small_s, io_path


def run(
    size: int,
    device: str = "auto",
    *,
    repeats: int = 5,
    small: int = 500,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Measure loads over REST against in-process reads of one ``size``-byte file."""
    # Imported here, not at the top: the client is its own package and only this bench needs
    # it, so listing or importing the other benches never depends on it.
    from tierd_client import Buffer, Client

    if size < 4096 or repeats < 1 or small < 1:
        raise ValueError("size must be at least 4 KiB, repeats and small at least 1")
    device = default_device() if device == "auto" else device
    materialise = materialiser(device)
    setup: dict[str, Any] = {"device": device, "gpu": gpu_name(device), "size_bytes": size}
    setup |= {"repeats": repeats, "small": small}
    with tempfile.TemporaryDirectory(prefix="tierd-bench-") as tmp:
        data = Path(tmp) / "data"
        path = data / "nvme" / "bench" / "big.bin"
        say(f"writing {format_size(size)} to {path} and starting tierd on it")
        _write(path, size)
        with _server(data) as url, Client(url) as api:
            fid = int(api.file("bench/big.bin")["id"])
            say(f"in process: {repeats} whole-file reads, {small} 4 KiB reads")
            local, small_local, setup["io_path_in_process"] = _in_process(
                device, data, path, size, repeats, small
            )

            say(f"over REST: {repeats} whole-file loads, {small} 4 KiB loads")
            rest: list[float] = []
            paths = set()
            for i in range(repeats + _WARMUP):
                t0 = time.perf_counter()
                b = api.load(fid, device=device)
                view = materialise(b)
                dt = time.perf_counter() - t0
                paths.add(b.info["io_path"])
                setup["server_read_gbps_last"] = b.info["gbps"]
                del view
                b.close()
                del b  # the client's mapping closes here, outside the timed part
                if i >= _WARMUP:
                    rest.append(dt)
            setup["io_path_rest"] = sorted(paths)
            small_rest: list[float] = []
            http_only: list[float] = []
            release: list[float] = []
            for i in range(small + _SMALL_WARMUP):
                off = (i * 7919 % (size // 4096)) * 4096
                body = {"file_id": fid, "offset": off, "length": 4096, "device": device}
                t0 = time.perf_counter()
                info = api.request("POST", "/v1/load", json=body)
                th = time.perf_counter()
                b = Buffer(api, info)
                view = materialise(b)
                t1 = time.perf_counter()
                del view
                b.close()
                del b
                t2 = time.perf_counter()
                if i >= _SMALL_WARMUP:
                    small_rest.append(t1 - t0)
                    http_only.append(th - t0)
                    release.append(t2 - t1)
    return _report(setup, local, rest, small_local, small_rest, http_only, release)


def _report(
    setup: dict[str, Any],
    local: list[float],
    rest: list[float],
    small_local: list[float],
    small_rest: list[float],
    http_only: list[float],
    release: list[float],
) -> Report:
    size, device = setup["size_bytes"], setup["device"]
    into = "a torch tensor" if device.startswith("cuda") else "a NumPy array"
    report = Report(
        "rest",
        f"tierd bench rest: {describe_device(setup)}, "
        f"{format_size(size)} file, the client in its own "
        f"process, medians of {setup['repeats']}, 4 KiB percentiles of {setup['small']}",
        setup,
    )
    add = report.add
    add(
        BenchRow(
            "in_process_gbps",
            "tiering.io read in-process, hot",
            gbps(size, statistics.median(local)),
            "GB/s",
            note=f"(path={setup['io_path_in_process']})",
        )
    )
    add(
        BenchRow(
            "rest_gbps",
            f"REST load until {into} in the client, hot",
            gbps(size, statistics.median(rest)),
            "GB/s",
            note=f"(path={','.join(setup['io_path_rest'])})",
        )
    )
    report.compare("rest_gbps", "in_process_gbps", 0.8)

    def us(samples: list[float], q: float) -> float:
        return percentile(samples, q) * 1e6

    local_p50 = us(small_local, 50)
    add(BenchRow("in_process_4k_p50_us", "4 KiB read in-process, p50", local_p50, "us"))
    add(BenchRow("rest_4k_p50_us", "4 KiB REST load, p50", us(small_rest, 50), "us"))
    add(BenchRow("rest_4k_p99_us", "4 KiB REST load, p99", us(small_rest, 99), "us"))
    overhead = us(small_rest, 50) - local_p50
    add(
        BenchRow(
            "overhead_4k_p50_us",
            "4 KiB REST overhead over in-process p50, p50",
            overhead,
            "us",
            target="<= 2000 us",
            met=overhead <= 2000,
        )
    )
    add(
        BenchRow(
            "overhead_4k_p99_us",
            "4 KiB REST overhead over in-process p50, p99",
            us(small_rest, 99) - local_p50,
            "us",
        )
    )
    add(
        BenchRow("rest_4k_http_p50_us", "  of which the HTTP request, p50", us(http_only, 50), "us")
    )
    add(
        BenchRow(
            "release_p50_us", "releasing the lease (a second request), p50", us(release, 50), "us"
        )
    )
    return report
