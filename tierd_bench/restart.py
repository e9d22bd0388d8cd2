"""``tierd bench restart``: a serving process that restarts, against its first start.

Issue 28's measure of GPU residency that outlives its lease. The service runs in its own
process with one file of ``size`` bytes on its fastest tier and staged into its memory tier
(pinned host memory). Every load is made by a **fresh client process** that loads the file
over REST into ``device``, makes it a torch tensor (CUDA IPC opened, device synchronised),
checks its bytes, and exits; the clock runs inside the client from the request to the usable
tensor (its interpreter's start-up, torch's and the client's CUDA bindings' (cupy) imports and
CUDA context are not counted: a serving process pays them once at start, the same in every
row).

- **memory tier**: plain loads while nothing is resident on the GPU (source ``memory``): the
  reference, what every restart paid before copies outlived their lease;
- **first start**: the first ``shared=true`` load (source ``memory``); its copy stays on the
  GPU after the process exits (kept by tierd, ``kept_bytes`` row);
- **restart, shared**: a new process's ``shared=true`` load: handed the same allocation (source
  ``gpu``, nothing read or copied); against the memory tier (target >= 5x) and the first start;
- **restart, plain**: a new process's own copy of it, device -> device (source ``gpu``).

It runs only on a GPU.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tierd_client import Client

from ._measure import GiB, MiB, default_device, format_size, gbps, gpu_name
from ._report import BenchRow, Report, describe_device
from .rest import server_process

__all__ = ["run"]

NAME = "bench/restart.bin"

# One client process: the load, timed from the request to a usable tensor, and its check.
_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import torch
    from tierd_client import Client

    args = json.loads(sys.argv[1])
    dev = args["device"]
    torch.zeros(1, device=dev)  # CUDA up before the clock: the same in every row
    import cupy  # the client's CUDA IPC bindings, loaded once at start as a server does
    cupy.cuda.Device(int(dev.partition(":")[2] or 0)).use()
    with Client(args["url"], timeout=600) as api:
        t0 = time.perf_counter()
        with api.load(args["file"], device=dev, shared=args["shared"]) as b:
            t = torch.from_dlpack(b)
            torch.cuda.synchronize(dev)
            seconds = time.perf_counter() - t0
            n, edge = t.numel(), args["edge"]
            ok = (
                t[:edge].cpu().numpy().tobytes() == bytes.fromhex(args["head"])
                and t[n - edge:].cpu().numpy().tobytes() == bytes.fromhex(args["tail"])
                and int(t.view(torch.int64).sum().item()) == args["sum"]
            )
            print(json.dumps({
                "seconds": seconds, "source": b.source, "reused": b.reused, "ok": ok,
                "io_path": b.info.get("io_path"), "ipc": b.info["handle"].get("ipc_handle"),
            }))
    """
)


def _client(url: str, device: str, shared: bool, expect: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    args = {"url": url, "device": device, "shared": shared, "file": NAME, **expect}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the client process failed: {done.stderr.strip()[-2000:]}")
    seen: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if not seen["ok"]:
        raise RuntimeError(f"a {'shared' if shared else 'plain'} load returned wrong bytes")
    return seen


def run(
    size: int = 4 << 30,
    device: str = "auto",
    *,
    repeats: int = 3,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Measure a restarted client's load of a resident file against the memory tier's."""
    device = default_device() if device == "auto" else device
    if not device.startswith("cuda"):
        raise RuntimeError("tierd bench restart needs a GPU (GPU residency)")
    if size < MiB or repeats < 1:
        raise ValueError("size must be at least 1 MiB and repeats at least 1")
    size -= size % 8  # the client's check sums the bytes as int64 words
    setup: dict[str, Any] = {"device": device, "gpu": gpu_name(device), "size_bytes": size}
    setup["repeats"] = repeats
    report = Report(
        "restart",
        f"tierd bench restart: {format_size(size)}, {describe_device(setup)}, "
        f"medians of {repeats} client processes",
        setup,
    )
    with tempfile.TemporaryDirectory(prefix="tierd-bench-") as tmp:
        root = Path(tmp)
        path = root / "nvme" / NAME
        path.parent.mkdir(parents=True)
        say(f"writing {format_size(size)} under {root / 'nvme'}")
        data = np.random.default_rng(28).integers(0, 256, size, dtype=np.uint8)
        data.tofile(path)
        edge = 4096  # hex in the client's argv, which caps one argument at 128 KiB
        expect = {
            "edge": edge,
            "head": data[:edge].tobytes().hex(),
            "tail": data[size - edge :].tobytes().hex(),
            # Two's-complement wrap-around, as torch's int64 sum on the GPU.
            "sum": int(data.view(np.int64).sum(dtype=np.int64)),
        }
        del data
        tiers = [
            {"name": "ram", "kind": "memory", "quota_bytes": 2 * size + GiB},
            {"name": "nvme", "path": str(root / "nvme")},
        ]
        env = {
            "TIERD_TIERS": json.dumps(tiers),
            "TIERD_BUFFERS__GPU_BUDGET_BYTES": str(2 * size + GiB),
            "TIERD_LOG_LEVEL": "warning",
        }
        with server_process(root / "data", env=env) as (url, _pid):
            _measure(report, url, device, size, repeats, expect, say)
    return report


def _measure(
    report: Report,
    url: str,
    device: str,
    size: int,
    repeats: int,
    expect: dict[str, Any],
    say: Callable[[str], None],
) -> None:
    def loads(shared: bool, source: str, n: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(n):
            seen = _client(url, device, shared, expect)
            if seen["source"] != source:
                raise RuntimeError(f"expected a load from {source}, got {seen['source']}")
            out.append(seen)
        return out

    def rate(key: str, label: str, seen: list[dict[str, Any]]) -> float:
        t = float(statistics.median(s["seconds"] for s in seen))
        report.add(BenchRow(key, label, gbps(size, t), "GB/s"))
        return t

    with Client(url, timeout=600) as api:
        say("staging the file into the memory tier")
        api.prefetch([NAME], target="memory", wait=True, progress=False)

        say("memory tier: plain loads, nothing resident")
        loads(False, "memory", 1)  # warm-up: the server's first CUDA work
        rate("memory", f"load -> {device}, memory tier", loads(False, "memory", repeats))

        say("first start: a shared load")
        (first,) = loads(True, "memory", 1)
        t_first = rate("first_start", "first start, shared=true", [first])
        kept = sum(api.buffers().get("kept_bytes", {}).values())
        report.add(
            BenchRow(
                "kept_bytes",
                "  kept on the GPU after the process exited",
                float(kept),
                "B",
                target=f">= {size}",
                met=kept >= size,
            )
        )

        say("restart: shared loads of the kept copy")
        again = loads(True, "gpu", repeats)
        if any(not s["reused"] or s["ipc"] != first["ipc"] for s in again):
            raise RuntimeError("a restarted shared load was not handed the kept allocation")
        t_again = rate("restart_shared", "restarted, shared=true (same allocation)", again)
        report.compare("restart_shared", "memory", 5)
        report.add(
            BenchRow("restart_shared_vs_first", "  vs the first start", t_first / t_again, "x")
        )

        say("restart: plain loads, copied on the GPU")
        copies = loads(False, "gpu", repeats)
        rate("restart_copy", "restarted, plain (device -> device copy)", copies)
        report.compare("restart_copy", "memory", 1)
