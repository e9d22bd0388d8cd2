"""``tierd bench multi-gpu``: one storage read filling several GPUs, and tensor-parallel
slices straight to their GPUs (issue 12's measures). Needs a host with at least two GPUs.

Files on the fastest storage tier, hot in the page cache; one in-process
:class:`~tiering.serving.Loader`. Each row is a median of ``repeats`` (at least 3) after one
warm-up; every lease is released before the next load. Rows and their targets:

- **replicate**: a ``size`` byte file to ``cuda:0`` and ``cuda:1`` (one ``load`` to a
  two-GPU ``LoadTarget``), against the same file to one GPU: at most 1.15 × the time. The
  note says the delivery and the probe it was chosen by (peer copy against staging through
  the host);
- **TP=2 one request**: a 4-shard bf16 checkpoint of ``size`` bytes split in two along dim 0
  (half to each GPU, ``rank=None``), against the full checkpoint to one GPU: at most 0.6 ×;
- **replicate vs safetensors**: the checkpoint replicated to both GPUs by one
  ``load_safetensors`` to a two-GPU ``LoadTarget``, against ``safetensors.torch.load_file``
  once per GPU: at least 10 × faster;
- **dim 1, strided** and **dim 1, read + cut**: the TP=2 split along dim 1 with row segments
  above and below :data:`~tiering.serving.sharded.STRIDED_MIN_SEGMENT`, for choosing it;
- **ceilings**: page cache → pinned host memory on every core, and pinned host memory → one
  GPU and → two GPUs at once: what the rows above run into;
- **memory tier**: the checkpoint held in pinned host memory (no page-cache copy), the TP=2
  split against the whole checkpoint to one GPU again: at most 0.6 ×;
- **REST, per rank**: one tierd server and worker processes opening their buffers by CUDA
  IPC (see :mod:`._ranks`): two processes each asking for their own rank (``rank=k``) at the
  same time, against one process asking for every rank in one request: at most 1.2 ×.

Rates are GB/s of the bytes that land on the GPUs (a replica counts once per GPU).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from tiering.config import EngineConfig, TierConfig
from tiering.engine import Engine
from tiering.io import LoadTarget

from ._measure import GiB, MiB, format_size, free_gpu, gbps, gpu_name
from ._report import BenchRow, Report, describe_device

#: The TP=2 splits the rows measure: every tensor along dim 0, or along dim 1.
_SPLIT0 = {"world_size": 2, "rules": [{"pattern": "*", "dim": 0}]}
_SPLIT1 = {"world_size": 2, "rules": [{"pattern": "*", "dim": 1}]}

__all__ = ["run"]

SHARDS = 4


def _gpu_count() -> int:
    try:
        import cupy as cp

        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def _sync() -> None:
    import cupy as cp

    for i in range(2):
        cp.cuda.Device(i).synchronize()


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` after one warm-up."""
    times = []
    for i in range(repeats + 1):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _checkpoint(root: Path, size: int, cols: int, prefix: str) -> list[str]:
    """``SHARDS`` bf16 safetensors shards of ``size`` bytes in all, each one tensor of
    ``cols`` columns; returns their relpaths."""
    import torch
    from safetensors.torch import save_file

    rows = max(2, size // SHARDS // (2 * cols))
    names = []
    for i in range(SHARDS):
        rel = f"bench/{prefix}{i}.safetensors"
        t = torch.randn(rows, cols, dtype=torch.float32).to(torch.bfloat16)
        save_file({f"layers.{i}.w": t}, str(root / "nvme" / rel))
        names.append(rel)
    return names


def run(size: int = 4 << 30, *, repeats: int = 3, say: Callable[[str], None] = print) -> Report:
    """Measure issue 12's table; refuses with fewer than two GPUs."""
    from tiering.serving import Loader, LoaderConfig
    from tiering.serving.sharded import STRIDED_MIN_SEGMENT

    if _gpu_count() < 2:
        raise RuntimeError("tierd bench multi-gpu needs a host with at least 2 GPUs")
    if size < 64 * MiB or repeats < 3:
        raise ValueError("size must be at least 64 MiB and repeats at least 3")
    setup: dict[str, Any] = {"device": "cuda:0", "gpu": gpu_name("cuda:0"), "size_bytes": size}
    setup |= {"repeats": repeats, "gpus": _gpu_count(), "strided_min": STRIDED_MIN_SEGMENT}
    title = f"tierd bench multi-gpu: {format_size(size)}, {describe_device(setup)}"
    report = Report("multi-gpu", f"{title}, medians of {repeats}", setup)
    with tempfile.TemporaryDirectory(prefix="tierd-bench-") as tmp:
        root = Path(tmp)
        (root / "nvme" / "bench").mkdir(parents=True)
        say(f"writing {format_size(size)} of files under {root / 'nvme'}")
        np.random.default_rng(12).integers(0, 256, size, dtype=np.uint8).tofile(
            root / "nvme" / "bench" / "blob.bin"
        )
        # Wide rows: dim-1 segments of 1 MiB (strided); narrow: 2 KiB (read + cut).
        ckpt = _checkpoint(root, size, 1 << 20, "wide")
        narrow = _checkpoint(root, min(size, GiB), 2048, "narrow")
        tiers = (
            TierConfig("ram", kind="memory", quota_bytes=size + GiB),
            TierConfig("nvme", root / "nvme"),
            TierConfig("ssd", root / "ssd"),
        )
        config = EngineConfig(
            tiers=tiers,
            catalog_url=f"sqlite:///{root / 'catalog.db'}",
            watch=False,
        )
        # No scheduler: the policy must not stage files into memory by their heat mid-run.
        eng = Engine(config).start(scheduler=False)
        try:
            budget = 2 * size + GiB
            loader = Loader(eng, LoaderConfig(gpu_budget_bytes=budget)).start()
            try:
                _measure(report, loader, root, ckpt, narrow, size, repeats, say)
            finally:
                loader.stop()
                free_gpu()
            _rest_ranks(report, root, ckpt, repeats, say)
        finally:
            eng.stop()
    return report


def _add_rate(report: Report, key: str, label: str, nbytes: int, t: float, note: str = "") -> None:
    """Two rows: GB/s of ``nbytes`` in ``t`` seconds (``key``), and the time (``key_s``)."""
    report.add(BenchRow(key, label, gbps(nbytes, t), "GB/s", note=note))
    report.add(BenchRow(f"{key}_s", f"  time of {label}", t, "s"))


def _release(loader: Any, out: Any) -> None:
    ids: list[str] = []
    for item in out if isinstance(out, list) else [out]:
        if hasattr(item, "lease"):
            ids.append(item.lease.id)
        elif hasattr(item, "loaded"):
            ids.extend(lease.id for lease in item.loaded.leases)
        elif hasattr(item, "leases"):
            ids.extend(lease.id for lease in item.leases)
        else:
            ids.append(item.id)
    loader.leases.release_many(ids)


def _measure(
    report: Report,
    loader: Any,
    root: Path,
    ckpt: list[str],
    narrow: list[str],
    size: int,
    repeats: int,
    say: Callable[[str], None],
) -> None:
    gpus = ["cuda:0", "cuda:1"]
    two = LoadTarget.parse(devices=gpus)
    split0 = LoadTarget.parse(devices=gpus, sharding=_SPLIT0)
    split1 = LoadTarget.parse(devices=gpus, sharding=_SPLIT1)

    def rate(key: str, label: str, nbytes: int, fn: Callable[[], Any], note: str = "") -> None:
        say(label)

        def once() -> None:
            _release(loader, fn())

        _add_rate(report, key, label, nbytes, _timed(once, repeats), note)

    blob = "bench/blob.bin"
    rate("one_gpu", "file to 1 GPU", size, lambda: loader.load(blob, device="cuda:0"))
    how: list[str] = []

    def replicate() -> Any:
        reps = loader.load(blob, device=two)
        how[:] = [reps[-1].delivery]
        return reps

    rate("replicate", "file replicated to 2 GPUs", 2 * size, replicate)
    _note_delivery(report, how[0] if how else "?")
    report.compare("replicate_s", "one_gpu_s", at_most=1.15)

    ck = sum((root / "nvme" / p).stat().st_size for p in ckpt)
    rate(
        "ckpt_one",
        "checkpoint to 1 GPU",
        ck,
        lambda: loader.load_safetensors(ckpt, device="cuda:0"),
    )
    rate(
        "tp_one_request",
        "TP=2 split, one request",
        ck,
        lambda: loader.load_safetensors(ckpt, device=split0),
    )
    report.compare("tp_one_request_s", "ckpt_one_s", at_most=0.6)

    rate(
        "replicate_ckpt",
        "checkpoint replicated to 2 GPUs",
        2 * ck,
        lambda: loader.load_safetensors(ckpt, device=two),
    )
    _load_file_per_gpu(report, [str(root / "nvme" / p) for p in ckpt], gpus, ck, repeats, say)
    report.compare("replicate_ckpt", "st_load_file", at_least=10)

    nb = sum((root / "nvme" / p).stat().st_size for p in narrow)
    rate(
        "dim1_strided",
        "TP=2 dim 1, strided reads (1 MiB segments)",
        ck,
        lambda: loader.load_safetensors(ckpt, device=split1),
    )
    rate(
        "dim1_cut",
        "TP=2 dim 1, read + cut (2 KiB segments)",
        nb,
        lambda: loader.load_safetensors(narrow, device=split1),
    )
    _ceilings(report, root / "nvme" / blob, size, repeats, say)
    _from_memory(report, loader, ckpt, ck, repeats, say)


def _note_delivery(report: Report, how: str) -> None:
    """The replicate row's note: the delivery, and the probe it was chosen by (gpu_delivery
    auto), per pair of GPUs."""
    from tiering.io import fanout

    probes = fanout.measured()
    report.setup["delivery_probes"] = probes
    seen = "; ".join(
        f"{pair} peer {r['peer_gbps']:.0f} vs host {r['host_gbps']:.0f} GB/s"
        for pair, r in probes.items()
    )
    report.rows["replicate"].note = f"delivery: {how} ({seen or 'no probe'})"


def _load_file_per_gpu(
    report: Report,
    paths: list[str],
    gpus: list[str],
    ck: int,
    repeats: int,
    say: Callable[[str], None],
) -> None:
    """The baseline: safetensors.torch.load_file of the checkpoint, once per GPU."""
    from safetensors.torch import load_file

    say("safetensors.torch.load_file once per GPU")
    t_st = _timed(lambda: [load_file(p, device=d) for d in gpus for p in paths], repeats)
    report.add(BenchRow("st_load_file", "load_file once per GPU", gbps(2 * ck, t_st), "GB/s"))


def _ceilings(
    report: Report, path: Path, size: int, repeats: int, say: Callable[[str], None]
) -> None:
    """The host's ceilings the rows above run into: page cache → pinned host memory on every
    core (what every hot read from storage must pass through, whatever its GPU), and pinned
    host memory → one GPU, and → two GPUs at once (each over its own link)."""
    import cupy as cp

    say("ceilings: page cache -> host memory, host -> GPUs")
    pinned = cp.cuda.alloc_pinned_memory(size)
    host = np.frombuffer(pinned, dtype=np.uint8, count=size)
    threads = os.cpu_count() or 1
    fd = os.open(path, os.O_RDONLY)
    try:
        parts = [(k * size // threads, (k + 1) * size // threads) for k in range(threads)]

        def read(lo: int, hi: int) -> None:
            view = host.data[lo:hi]
            done = 0
            while done < hi - lo:
                done += os.preadv(fd, [view[done : done + (64 << 20)]], lo + done)

        with ThreadPoolExecutor(threads) as pool:
            t = _timed(lambda: list(pool.map(lambda p: read(*p), parts)), repeats)
    finally:
        os.close(fd)
    report.add(
        BenchRow(
            "host_read", f"page cache -> host memory, {threads} threads", gbps(size, t), "GB/s"
        )
    )
    dst = []
    for i in range(2):
        with cp.cuda.Device(i):
            dst.append((cp.empty(size, dtype=cp.uint8), cp.cuda.Stream(non_blocking=True)))

    def h2d(gpus: int) -> None:
        n = size // gpus
        for i in range(gpus):
            arr, stream = dst[i]
            cp.cuda.runtime.memcpyAsync(arr.data.ptr, pinned.ptr + i * n, n, 1, stream.ptr)
        for _, stream in dst[:gpus]:
            stream.synchronize()

    t1 = _timed(lambda: h2d(1), repeats)
    report.add(BenchRow("h2d_one", "pinned host -> 1 GPU", gbps(size, t1), "GB/s"))
    t2 = _timed(lambda: h2d(2), repeats)
    report.add(BenchRow("h2d_two", "pinned host -> 2 GPUs at once", gbps(size, t2), "GB/s"))
    dst.clear()
    free_gpu()


def _from_memory(
    report: Report, loader: Any, ckpt: list[str], ck: int, repeats: int, say: Callable[[str], None]
) -> None:
    """The checkpoint held in the memory tier (pinned host memory: no page-cache copy, so
    nothing on the CPU): the TP split against the whole checkpoint to one GPU again."""
    say("memory tier: prefetch the checkpoint")
    job = loader.prefetch(ckpt, target="memory")
    while not job.finished:
        time.sleep(0.05)
    if job.state != "done":
        raise RuntimeError(f"prefetch into memory ended {job.state}: {job.errors}")
    tp = LoadTarget.parse(devices=["cuda:0", "cuda:1"], sharding=_SPLIT0)

    def checked(out: Any) -> Any:
        for item in out if isinstance(out, list) else [out]:
            leases = item.loaded.leases if hasattr(item, "loaded") else item.leases
            got = {lease.report.source for lease in leases if lease.report is not None}
            if got != {"memory"}:
                raise RuntimeError(f"expected loads from the memory tier, got {sorted(got)}")
        return out

    def rate(key: str, label: str, fn: Callable[[], Any]) -> None:
        say(label)
        _add_rate(report, key, label, ck, _timed(lambda: _release(loader, checked(fn())), repeats))

    rate(
        "mem_ckpt_one",
        "memory tier: checkpoint to 1 GPU",
        lambda: loader.load_safetensors(ckpt, device="cuda:0"),
    )
    rate(
        "mem_tp",
        "memory tier: TP=2 split, one request",
        lambda: loader.load_safetensors(ckpt, device=tp),
    )
    report.compare("mem_tp_s", "mem_ckpt_one_s", at_most=0.6)


def _rest_ranks(
    report: Report, root: Path, ckpt: list[str], repeats: int, say: Callable[[str], None]
) -> None:
    """The TP=2 split as serving engines ask for it: worker processes over REST, each opening
    its buffers by CUDA IPC; one request for every rank against one process per rank."""
    from ._ranks import per_rank_processes

    files = [root / "nvme" / p for p in ckpt]
    ck = sum(f.stat().st_size for f in files)
    one, each = per_rank_processes(files, _SPLIT0, ["cuda:0", "cuda:1"], repeats, say)
    for key, label, t in (
        ("rest_tp_one", "REST: TP=2 split, one request (1 process)", one),
        ("rest_tp_per_rank", "REST: TP=2 split, each rank for itself (2 processes)", each),
    ):
        _add_rate(report, key, label, ck, t)
    report.compare("rest_tp_per_rank_s", "rest_tp_one_s", at_most=1.2)
