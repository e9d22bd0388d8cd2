"""Loads over REST against tiering.io in-process, on one GPU host.

    python -m tiering.bench.rest [--size-mib 1024] [--device cuda:0] [--out bench.json]

Starts ``tierd`` (uvicorn, its own process) on a temporary data dir holding one file on the
fastest tier, and measures from this process, the client:

- **throughput**: a hot file from ``POST /v1/load`` until it is a torch tensor here (CUDA IPC
  opened, ``torch.from_dlpack``, device synchronised), against ``GpuDirectStorage.read`` of
  the same file in this process; medians of ``--repeat`` after a warm-up.
- **4 KiB overhead**: the same for a 4 KiB range, p50 and p99 of ``--small`` loads, minus the
  in-process 4 KiB read's p50. Releasing the lease is a second request, reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from app.client import Buffer, Client


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def _free_port() -> int:
    import socket

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


def _serve(data_dir: Path, port: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "TIERD_DATA_DIR": str(data_dir),
        "TIERD_WATCH": "false",
        "TIERD_PORT": str(port),
    }
    cmd = [sys.executable, "-m", "uvicorn", "app.main:create_app", "--factory",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    return subprocess.Popen(cmd, env=env)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tierd exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("tierd did not become ready")


def run(size: int, device: str, repeat: int, small: int) -> dict[str, Any]:
    import cupy as cp
    import torch

    from tiering.config import TierConfig
    from tiering.io import GpuDirectStorage

    out: dict[str, Any] = {"size_bytes": size, "device": device}
    with tempfile.TemporaryDirectory(prefix="tierd-bench-") as tmp:
        data = Path(tmp) / "data"
        path = data / "nvme" / "bench" / "big.bin"
        _write(path, size)
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        proc = _serve(data, port)
        try:
            _wait_ready(url, proc)
            api = Client(url)
            fid = int(api.file("bench/big.bin")["id"])
            dev_index = int(device.partition(":")[2] or 0)
            sync = torch.cuda.synchronize

            # -- in-process: tiering.io into this process's GPU memory ------------------
            tiers = [TierConfig(n, data / n) for n in ("nvme", "ssd", "hdd")]
            with GpuDirectStorage(device, tiers=tiers) as gds, gds.open_file(path) as f:
                out["io_path_in_process"] = f.io_path
                local: list[float] = []
                for i in range(repeat + 2):
                    t0 = time.perf_counter()
                    r = gds.read(f)
                    cp.cuda.Device(dev_index).synchronize()
                    dt = time.perf_counter() - t0
                    del r
                    if i >= 2:
                        local.append(dt)
                small_local: list[float] = []
                for i in range(small + 20):
                    off = (i * 7919 % (size // 4096)) * 4096
                    t0 = time.perf_counter()
                    r = gds.read(f, off, 4096)
                    cp.cuda.Device(dev_index).synchronize()
                    dt = time.perf_counter() - t0
                    del r
                    if i >= 20:
                        small_local.append(dt)
            cp.get_default_memory_pool().free_all_blocks()

            # -- REST: request until a torch tensor in this process ---------------------
            rest: list[float] = []
            paths = set()
            for i in range(repeat + 2):
                t0 = time.perf_counter()
                b = api.load(fid, device=device)
                t = torch.from_dlpack(b)
                sync()
                dt = time.perf_counter() - t0
                assert t.data_ptr() == b.__cuda_array_interface__["data"][0]
                paths.add(b.info["io_path"])
                server_gbps = b.info["gbps"]
                del t
                b.close()
                del b  # the client's IPC mapping closes here, outside the timed part
                if i >= 2:
                    rest.append(dt)
            out["io_path_rest"] = sorted(paths)
            out["server_read_gbps_last"] = server_gbps
            small_rest: list[float] = []
            http_only: list[float] = []
            release: list[float] = []
            for i in range(small + 20):
                off = (i * 7919 % (size // 4096)) * 4096
                t0 = time.perf_counter()
                info = api.request(
                    "POST",
                    "/v1/load",
                    json={"file_id": fid, "offset": off, "length": 4096, "device": device},
                )
                th = time.perf_counter()
                b = Buffer(api, info)
                t = torch.from_dlpack(b)
                sync()
                t1 = time.perf_counter()
                del t
                b.close()
                del b
                t2 = time.perf_counter()
                if i >= 20:
                    small_rest.append(t1 - t0)
                    http_only.append(th - t0)
                    release.append(t2 - t1)
            api.close()
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    med_local, med_rest = statistics.median(local), statistics.median(rest)
    out["in_process_gbps"] = round(size / med_local / 1e9, 2)
    out["rest_gbps"] = round(size / med_rest / 1e9, 2)
    out["rest_vs_in_process"] = round(med_local / med_rest, 3)
    out["in_process_4k_p50_us"] = round(_pct(small_local, 50) * 1e6, 1)
    out["rest_4k_p50_us"] = round(_pct(small_rest, 50) * 1e6, 1)
    out["rest_4k_p99_us"] = round(_pct(small_rest, 99) * 1e6, 1)
    out["overhead_4k_p50_us"] = round((_pct(small_rest, 50) - _pct(small_local, 50)) * 1e6, 1)
    out["overhead_4k_p99_us"] = round((_pct(small_rest, 99) - _pct(small_local, 50)) * 1e6, 1)
    out["rest_4k_http_p50_us"] = round(_pct(http_only, 50) * 1e6, 1)
    out["release_p50_us"] = round(_pct(release, 50) * 1e6, 1)
    out["repeat"], out["small"] = repeat, small
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--small", type=int, default=500)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    result = run(a.size_mib << 20, a.device, a.repeat, a.small)
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
