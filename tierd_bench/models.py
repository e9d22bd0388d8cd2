"""``tierd bench models``: one model load over REST against its shards loaded one at a time.

Issue 13's measure. The service runs in its own process (as in ``tierd bench rest``) on a
temporary data dir holding one Hugging Face style model on the fastest tier: ``shards``
safetensors files of equal size and ``model.safetensors.index.json``. From this process, the
client, each timed run loads every tensor into ``device`` and makes it usable here (torch
tensors on a GPU, synchronised; NumPy views on ``cpu``):

- **model**: one ``POST /v1/models/load`` (the server loads the shards concurrently);
- **shards one at a time**: ``POST /v1/load/safetensors`` per shard, in order, as a client
  that knows the shard names would.

Medians of ``repeats`` after a warm-up; the leases are released outside the clock. Every
run's tensors are checked (their count and bytes, hashed after the clock stopped).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tiering.checksum import Hasher

from ._measure import MiB, default_device, format_size, gbps, gpu_name
from ._report import BenchRow, Report, describe_device
from .rest import server_process

__all__ = ["run"]

NAME = "models/bench-model"
TENSORS_PER_SHARD = 8
_WARMUP = 1


def _write_model(root: Path, size: int, shards: int) -> tuple[int, str]:
    """``shards`` safetensors files (F32 tensors, seeded random bytes) and their index under
    ``root / NAME``; returns (tensor count, checksum of every tensor's bytes in name order)."""
    from safetensors.numpy import save_file

    model = root / NAME
    model.mkdir(parents=True)
    rng = np.random.default_rng(13)
    per = max(4, size // shards // TENSORS_PER_SHARD // 16 * 4)  # float32s a tensor, rows of 4
    weight_map: dict[str, str] = {}
    digests: dict[str, bytes] = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for t in range(TENSORS_PER_SHARD):
            name = f"layers.{s}.w{t}"
            arr = rng.standard_normal(per, dtype=np.float32).reshape(-1, 4)
            tensors[name] = arr
            weight_map[name] = shard
            digests[name] = arr.tobytes()
        save_file(tensors, str(model / shard))
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (model / "config.json").write_text("{}")
    h = Hasher()
    for name in sorted(digests):
        h.update(digests[name])
    return len(weight_map), h.value()


def _checker(device: str, count: int, expected: str) -> Callable[[dict[str, Any]], None]:
    def check(tensors: dict[str, Any]) -> None:
        if len(tensors) != count:
            raise AssertionError(f"{len(tensors)} tensors loaded, {count} expected")
        h = Hasher()
        for name in sorted(tensors):
            arr = tensors[name]
            host = arr.get() if device.startswith("cuda") else np.asarray(arr)
            h.update(np.ascontiguousarray(host).view(np.uint8).data)
        if h.value() != expected:
            raise AssertionError("the tensors loaded differ from the model's bytes")

    return check


def run(
    size: int = 4 << 30,
    device: str = "auto",
    *,
    shards: int = 4,
    repeats: int = 5,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Measure one model load against per-shard loads of the same ``size``-byte model."""
    from tierd_client import Client

    if size < shards * MiB or shards < 1 or repeats < 1:
        raise ValueError("shards and repeats must be at least 1, size at least 1 MiB a shard")
    device = default_device() if device == "auto" else device
    setup: dict[str, Any] = {"device": device, "gpu": gpu_name(device), "size_bytes": size}
    setup |= {"shards": shards, "repeats": repeats, "model": NAME}
    report = Report(
        "models",
        f"tierd bench models: {format_size(size)} in {shards} shards, {describe_device(setup)}, "
        f"medians of {repeats}",
        setup,
    )
    with tempfile.TemporaryDirectory(prefix="tierd-bench-") as tmp:
        data = Path(tmp) / "data"
        say(f"writing a {format_size(size)} model in {shards} shards")
        count, expected = _write_model(data / "nvme", size, shards)
        check = _checker(device, count, expected)
        with server_process(data) as (url, _), Client(url) as api:
            info = api.model(NAME)
            shard_paths = [f"{NAME}/{s}" for s in info["layout"]["shards"]]
            nbytes = int(info["weight_bytes"])
            setup["weight_bytes"] = nbytes

            def model() -> list[Any]:
                return [api.load_model(NAME, device=device)]

            def one_by_one() -> list[Any]:
                return [api.load_safetensors(p, device=device) for p in shard_paths]

            for key, label, fn in (
                ("model_load", "POST /v1/models/load (one request)", model),
                ("shards_serial", "POST /v1/load/safetensors a shard at a time", one_by_one),
            ):
                say(f"{label}: {repeats} runs")
                times = []
                for i in range(repeats + _WARMUP):
                    t0 = time.perf_counter()
                    loaded = fn()
                    arrays = {n: t[n] for t in loaded for n in t}
                    if device.startswith("cuda"):
                        import cupy

                        cupy.cuda.runtime.deviceSynchronize()
                    dt = time.perf_counter() - t0
                    check(arrays)
                    del arrays
                    for t in loaded:
                        t.close()
                    if i >= _WARMUP:
                        times.append(dt)
                t = statistics.median(times)
                note = f"({t * 1e3:.0f} ms)"
                report.add(BenchRow(key, label, gbps(nbytes, t), "GB/s", note=note))
    report.compare("model_load", "shards_serial", 1.0)
    return report
