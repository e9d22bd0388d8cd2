"""``tierd bench models``: a model's load over REST, its shards one at a time, the same as a
torch state dict (in-process and over REST, from the page cache and the memory tier, phase by
phase), and fastsafetensors on the same checkpoint.

Issues 13 and 28. The service runs in its own process (as in ``tierd bench rest``) on a
temporary data dir holding one Hugging Face style model on the fastest storage tier:
``shards`` safetensors files of equal size and ``model.safetensors.index.json``, with a memory
tier above it; its scheduler is off, so nothing moves mid-run. From this process, the client,
each timed run loads every tensor into ``device`` and makes it usable here (devices
synchronised):

- **model**: one ``POST /v1/models/load`` (the server loads the shards concurrently), against
  **shards one at a time**: ``POST /v1/load/safetensors`` per shard, in order;
- **state dict**: ``Client.load_state_dict`` of the shard files over REST, against
  ``tiering.io.state_dict.load_state_dict`` in this process (target: at least 0.9x), and a
  **profile** of the REST load: each phase's median on the client and on the server (see
  :mod:`._restprofile`), from the page cache and from the memory tier; the memory tier's load
  against the pinned host -> device ceiling (target: at least 0.95x);
- **fastsafetensors** (see :mod:`._modelpeers`): one device, out of the box and buffered,
  and on hosts with two GPUs its TP=2 and replicated loads against tierd's per-rank REST loads.

Medians of ``repeats`` after a warm-up; leases are released outside the clock. Every run's
tensors are checked (their count and bytes, hashed after the clock stopped).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tiering.checksum import Hasher

from . import _restprofile
from ._measure import GiB, MiB, default_device, device_sync, format_size, free_gpu, gpu_name
from ._modelpeers import Loaded, fastsafetensors_rows, host_bytes, rate_row, timed_loads
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
    # float32s a tensor, in rows of 4 and an even number of rows: a TP=2 split along dim 0
    # gives both ranks the same share (NCCL's and gloo's scatter want equal pieces).
    per = max(8, size // shards // TENSORS_PER_SHARD // 32 * 8)
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


def _checker(count: int, expected: str) -> Callable[[dict[str, Any]], None]:
    def check(tensors: dict[str, Any]) -> None:
        if len(tensors) != count:
            raise AssertionError(f"{len(tensors)} tensors loaded, {count} expected")
        h = Hasher()
        for name in sorted(tensors):
            h.update(host_bytes(tensors[name]).data)
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
    """Measure the model's loads (see the module docstring) of a ``size``-byte model."""
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
        check = _checker(count, expected)
        files = sorted((data / "nvme" / NAME).glob("*.safetensors"))
        tiers = [{"name": "ram", "kind": "memory", "quota_bytes": size + GiB}]
        tiers += [{"name": n, "path": str(data / n)} for n in ("nvme", "ssd", "hdd")]
        env = {"TIERD_TIERS": json.dumps(tiers)}
        with server_process(data, env=env) as (url, _):
            _serve(report, url, files, device, repeats, check, say)
        nbytes = int(setup["weight_bytes"])
        _in_process(report, data, device, repeats, check, nbytes, say)
        report.compare("rest_state_dict", "in_process_state_dict", 0.9)
        fastsafetensors_rows(report, files, nbytes, device, repeats, check, say)
    report.compare("model_load", "shards_serial", 1.0)
    return report


def _serve(
    report: Report,
    url: str,
    files: list[Path],
    device: str,
    repeats: int,
    check: Callable[[dict[str, Any]], None],
    say: Callable[[str], None],
) -> None:
    """The rows measured through the server at ``url``."""
    from tierd_client import Client

    from ._modelpeers import two_gpu_rows, two_gpus
    from ._ranks import _hold_still

    _hold_still(url)  # the scheduler must not move the model between the rows
    with Client(url) as api:
        info = api.model(NAME)
        shard_paths = [f"{NAME}/{s}" for s in info["layout"]["shards"]]
        nbytes = report.setup["weight_bytes"] = int(info["weight_bytes"])

        def model() -> Loaded:
            t = api.load_model(NAME, device=device)
            return dict(t), t.close

        def one_by_one() -> Loaded:
            loaded = [api.load_safetensors(p, device=device) for p in shard_paths]

            def close() -> None:
                for t in loaded:
                    t.close()

            return {n: t[n] for t in loaded for n in t}, close

        for key, label, fn in (
            ("model_load", "POST /v1/models/load (one request)", model),
            ("shards_serial", "POST /v1/load/safetensors a shard at a time", one_by_one),
        ):
            say(f"{label}: {repeats} runs")
            rate_row(report, key, label, nbytes, timed_loads(fn, device, repeats, check))
        free_gpu()
        if importlib.util.find_spec("torch") is None:
            why = "needs torch (pip install torch)"
            report.add(BenchRow("rest_state_dict", "REST load_state_dict", None, "GB/s", note=why))
            return
        rest = _Rest(report, api, shard_paths, device, repeats, check, nbytes, say)
        _state_dict(rest)
        # Before the memory tier holds the model: every rank reads the page cache, as
        # fastsafetensors does.
        gpus = two_gpus(device)
        two_gpu_rows(report, url, files, shard_paths, nbytes, gpus, repeats, say)
        _memory_tier(rest)


class _Rest(NamedTuple):
    """What the REST state-dict figures are measured with: the shards, the device, the
    check of a load's tensors and the model's bytes."""

    report: Report
    api: Any
    paths: list[str]
    device: str
    repeats: int
    check: Callable[[dict[str, Any]], None]
    nbytes: int
    say: Callable[[str], None]


def _state_dict(rest: _Rest) -> None:
    """The REST state dict from the page cache, and its profile."""
    report, api, paths, device, repeats, check, nbytes, say = rest

    def state_dict() -> Loaded:
        sd = api.load_state_dict(paths, device=device)

        def close() -> None:
            sd.clear()  # the keeper releases the leases once the tensors are gone...
            _settle(api)  # ...from its own thread: the next run must find them pooled

        return sd, close

    say(f"REST load_state_dict: {repeats} runs, then {repeats} profiled")
    label = "REST load_state_dict of the shards, page cache"
    t = timed_loads(state_dict, device, repeats, check)
    rate_row(report, "rest_state_dict", label, nbytes, t)
    prof = _restprofile.profile(api, paths, device, repeats, check)
    _restprofile.add_rows(report, "prof_page_cache", "REST state dict, page cache", prof)
    free_gpu()


def _memory_tier(rest: _Rest) -> None:
    """The REST state dict from the memory tier (profiled), against the pinned ceiling."""
    report, api, paths, device, repeats, check, nbytes, say = rest
    say("memory tier: prefetching the shards")
    api.prefetch(paths, target="memory", wait=True, progress=False, timeout=600)
    say(f"REST load_state_dict from the memory tier: {repeats} profiled runs")
    prof = _restprofile.profile(api, paths, device, repeats, check)
    # Said, not asserted: a copy resident on the GPU (source gpu) would be served first, and
    # the note must show it rather than the run die at its end.
    label = "REST load_state_dict, memory tier"
    t = statistics.median(prof.total)
    note = f"source: {', '.join(sorted(prof.sources))}"
    rate_row(report, "rest_state_dict_memory", label, nbytes, t, note)
    _restprofile.add_rows(report, "prof_memory", "REST state dict, memory tier", prof)
    free_gpu()
    if device.startswith("cuda"):
        _pinned_ceiling(report, device, nbytes, repeats)
        report.compare("rest_state_dict_memory", "ceil_pinned_h2d", 0.95)


def _settle(api: Any, timeout: float = 60.0) -> None:
    """Wait until the service holds no lease."""
    deadline = time.monotonic() + timeout
    while api.buffers()["items"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"leases still live {timeout:g} s after their tensors were freed")
        time.sleep(0.005)


def _pinned_ceiling(report: Report, device: str, nbytes: int, repeats: int) -> None:
    """One pinned host -> device copy of the model's size: what a memory-tier load can reach."""
    cp = importlib.import_module("cupy")
    with cp.cuda.Device(int(device.partition(":")[2] or 0)):
        host = cp.cuda.alloc_pinned_memory(nbytes)
        src = np.frombuffer(host, np.uint8, nbytes)
        src[:] = 1
        dst = cp.empty(nbytes, cp.uint8)
        sync = device_sync(device)
        times = []
        for i in range(max(5, repeats) + _WARMUP):
            sync()
            t0 = time.perf_counter()
            dst.set(src)
            sync()
            if i >= _WARMUP:
                times.append(time.perf_counter() - t0)
        del dst, src, host
        cp.get_default_pinned_memory_pool().free_all_blocks()  # 4 GiB of RAM, locked: give back
    free_gpu()
    t = statistics.median(times)
    rate_row(report, "ceil_pinned_h2d", "pinned host -> device copy", nbytes, t)


def _in_process(
    report: Report,
    data: Path,
    device: str,
    repeats: int,
    check: Callable[[dict[str, Any]], None],
    nbytes: int,
    say: Callable[[str], None],
) -> None:
    """``tiering.io.state_dict.load_state_dict`` of the model under ``data`` in this process."""
    label = "in-process load_state_dict (tiering.io), page cache"
    if importlib.util.find_spec("torch") is None:
        why = "needs torch (pip install torch)"
        report.add(BenchRow("in_process_state_dict", label, None, "GB/s", note=why))
        return
    from tiering.config import TierConfig
    from tiering.io import GpuDirectStorage
    from tiering.io.state_dict import load_state_dict

    # One storage for every run, with the service's tiers (their I/O settings): the service
    # keeps one too, so neither pays for starting its data path.
    tiers = [TierConfig(n, data / n) for n in ("nvme", "ssd", "hdd")]
    model = data / "nvme" / NAME
    with GpuDirectStorage(device, tiers=tiers) as gds:

        def load() -> Loaded:
            sd = load_state_dict(model, storage=gds)
            return sd, sd.clear

        say(f"{label}: {repeats} runs")
        t = timed_loads(load, device, repeats, check)
    rate_row(report, "in_process_state_dict", label, nbytes, t)
    free_gpu()
