"""A GPU's one-time costs paid at start, not by the first load.

A serving process's first load into a GPU used to take 0.74 s where every later one took
0.06 s (1.93 GB from the page cache, one H200): the CUDA context of the device, the data
path's KvikIO threads and pinned staging buffers, the lease budget's query, CuPy's first
kernels. An engine restarted beside a restarted tierd met that on its one load that counts.
:func:`warm_devices` pays them when the service starts: it builds each visible GPU's data path
and reads a small scratch safetensors file into it twice, through the same code a load of a
local file takes, then into an exportable allocation of the lease pool as a shard is read.
A host without CUDA warms nothing.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from tiering.io import Device, import_cupy
from tiering.serving.context import LoadContext

__all__ = ["WARM_BYTES", "warm_devices"]

log = logging.getLogger(__name__)

#: The scratch file read into each GPU: several of the data path's tasks, so its threads and
#: staging buffers are all made.
WARM_BYTES = 64 << 20


def _cuda_devices() -> list[Device]:
    # CUDA, not GDS proper: GpuDirectStorage.is_available() says whether cuFile and
    # nvidia-fs are there, which most hosts lack, and whose data path (KvikIO's compat mode)
    # is the one to warm all the same.
    try:
        count = int(import_cupy().cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no device: nothing to warm (loads say why)
        return []
    return [Device.parse(f"cuda:{i}") for i in range(count)]


def _scratch(path: str) -> None:
    """A safetensors file of :data:`WARM_BYTES`: one ``U8`` tensor, the header padded to 8."""
    header = json.dumps(
        {"w": {"dtype": "U8", "shape": [WARM_BYTES], "data_offsets": [0, WARM_BYTES]}}
    )
    head = header.encode() + b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        f.write(os.urandom(1 << 20) * (WARM_BYTES >> 20))


def warm_devices(ctx: LoadContext) -> dict[str, float]:
    """Warm every visible GPU's data path, at once; seconds per device. Failures are logged
    and left to the first load, which reports them as a load's error: a service that could
    not warm up still starts."""
    devices = _cuda_devices()
    if not devices:
        return {}
    try:
        with tempfile.TemporaryDirectory(prefix="tierd-warm-") as tmp:
            path = os.path.join(tmp, "scratch.safetensors")
            _scratch(path)
            out = _warm_all(ctx, devices, path)
    except OSError as exc:  # no room for the scratch file, say: the first load pays instead
        log.warning("could not warm the GPUs at start: %s", exc)
        return {}
    log.info("GPU data paths warmed: %s", {k: round(v, 3) for k, v in out.items()})
    return out


def _warm_all(ctx: LoadContext, devices: list[Device], path: str) -> dict[str, float]:
    def warm(dev: Device) -> float:
        t0 = time.perf_counter()
        ctx.budget(dev)
        storage = ctx.storage(dev)
        result = storage.load_file(path)
        del result
        # A load's own steps: an exportable allocation from the lease pool (cudaMalloc, its
        # IPC handle), a safetensors header and plan, the shard's read into it.
        pool = ctx.leases.pool
        buf = pool.get(dev, WARM_BYTES)
        try:
            storage.load_safetensors_raw([path], None, lambda n: buf.array()[:n])
            buf.handle()
        finally:
            pool.put(buf)  # the first load may take it
        return time.perf_counter() - t0

    out: dict[str, float] = {}
    with ThreadPoolExecutor(len(devices), "tierd-warm") as threads:
        futures = {str(d): threads.submit(warm, d) for d in devices}
        for name, fut in futures.items():
            try:
                out[name] = fut.result()
            except Exception as exc:
                log.warning("could not warm %s at start: %s", name, exc)
    return out
