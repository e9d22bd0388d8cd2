"""The rows of ``tierd bench models`` that set fastsafetensors beside tierd, and the timing and
checking every row of that bench shares.

- **one device** (:func:`fastsafetensors_rows`): fastsafetensors into this process, with its
  default O_DIRECT policy and buffered, each with the ratio of tierd's REST state dict to it;
- **two GPUs** (:func:`two_gpu_rows`, hosts with at least two): TP=2 (dim-0 slices) and
  replicas, one process per rank (see :mod:`._peerranks`), tierd over REST against
  fastsafetensors (``get_sharded``; ``get_tensor``'s broadcast), with the ratio of the two.

Rates are GB/s of the checkpoint's tensor bytes (as every row of the bench), whatever the
ranks hold between them. A peer that is
not installed or fails gives its rows no figure and a note saying why; one that loads wrong
bytes fails the run.
"""

from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.markup import escape

from . import _fastsafetensors as fst
from ._measure import device_sync, free_gpu, gbps
from ._report import BenchRow, Report

__all__ = [
    "fastsafetensors_rows",
    "host_bytes",
    "rate_row",
    "timed_loads",
    "two_gpu_rows",
    "two_gpus",
]

Loaded = fst.Loaded
_WARMUP = 1


def _name() -> str:
    """``fastsafetensors 0.5.0`` (the version installed), for the rows' labels."""
    return f"fastsafetensors {fst.version() if fst.missing() is None else '0.5'}"


def host_bytes(arr: Any) -> Any:
    """The bytes of a CuPy, NumPy or torch array, as a flat NumPy ``uint8`` array."""
    if hasattr(arr, "get"):  # CuPy
        return np.ascontiguousarray(arr.get()).reshape(-1).view(np.uint8)
    if type(arr).__module__.startswith("torch"):
        return fst.torch_bytes(arr)
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def timed_loads(
    load: Callable[[], Loaded],
    device: str,
    repeats: int,
    check: Callable[[dict[str, Any]], None],
) -> float:
    """Median seconds of ``load`` (until its tensors are usable: device synchronised) over
    ``repeats`` runs after a warm-up; each run's tensors checked and released, untimed."""
    sync = device_sync(device)
    times = []
    for i in range(repeats + _WARMUP):
        sync()
        t0 = time.perf_counter()
        tensors, close = load()
        sync()
        dt = time.perf_counter() - t0
        try:
            check(tensors)
        finally:
            tensors = {}
            close()
        if i >= _WARMUP:
            times.append(dt)
    return statistics.median(times)


def rate_row(report: Report, key: str, label: str, nbytes: int, t: float, note: str = "") -> None:
    """Row ``key``: GB/s of ``nbytes`` in ``t`` seconds, the time in the note."""
    note = f"({t * 1e3:.0f} ms) {note}".strip()
    report.add(BenchRow(key, label, gbps(nbytes, t), "GB/s", note=note))


def _none(report: Report, key: str, label: str, why: str) -> None:
    # Escaped: the table's renderer (rich) reads "[...]" as markup, and an error's text such
    # as gloo's "[/path/pair.cc:553] Connection closed" would stop the printing of the run.
    report.add(BenchRow(key, label, None, "GB/s", note=escape(why)))


def _ratio(report: Report, key: str, label: str, num: str, den: str) -> None:
    """Row ``key``: row ``num`` / row ``den`` (how many times faster), where both exist."""
    a, b = report.rows.get(num), report.rows.get(den)
    if a is not None and b is not None and a.value is not None and b.value:
        report.add(BenchRow(key, label, a.value / b.value, "x", note=f"({num} / {den})"))


def _failed(exc: BaseException) -> str:
    return f"failed: {type(exc).__name__}: {str(exc)[:300]}"


def fastsafetensors_rows(
    report: Report,
    files: Sequence[Path],
    nbytes: int,
    device: str,
    repeats: int,
    check: Callable[[dict[str, Any]], None],
    say: Callable[[str], None],
) -> None:
    """fastsafetensors into this process: ``fst_default`` and ``fst_buffered`` (and their
    ``_x`` ratios: tierd's REST state dict over them). Rates are of ``nbytes``."""
    rows = (
        ("fst_default", f"{_name()}, its default (O_DIRECT on local disks)", None),
        ("fst_buffered", f"{_name()}, buffered (FASTSAFETENSORS_ODIRECT=0)", False),
    )
    why = fst.missing()
    if why is not None:
        say(f"fastsafetensors rows skipped: {why}")
        for key, label, _ in rows:
            _none(report, key, label, why)
        return
    report.setup["fastsafetensors"] = fst.version()
    note = "(16 threads x 16 MiB bounce buffers, nogds)"
    for key, label, direct in rows:
        say(f"{label}: {repeats} runs")
        try:
            with fst.odirect(direct):
                t = timed_loads(lambda: fst.load_one(files, device), device, repeats, check)
        except AssertionError:
            raise  # wrong bytes: not a figure to print
        except Exception as exc:
            _none(report, key, label, _failed(exc))
            continue
        finally:
            free_gpu()
        rate_row(report, key, label, nbytes, t, note)
        _ratio(report, f"{key}_x", "  tierd REST state dict / it", "rest_state_dict", key)


def two_gpus(device: str) -> list[str] | None:
    """``["cuda:0", "cuda:1"]`` where ``device`` is a GPU of a host with at least two."""
    if not device.startswith("cuda"):
        return None
    try:
        count = int(importlib.import_module("cupy").cuda.runtime.getDeviceCount())
    except Exception:
        return None
    return ["cuda:0", "cuda:1"] if count >= 2 else None


def two_gpu_rows(
    report: Report,
    url: str,
    files: Sequence[Path],
    relpaths: Sequence[str],
    nbytes: int,
    devices: Sequence[str] | None,
    repeats: int,
    say: Callable[[str], None],
) -> None:
    """TP=2 and replicas on ``devices`` (two; :func:`two_gpus`), one process per rank: tierd
    over REST from the server at ``url`` (``relpaths``), and fastsafetensors (``files``).
    Nothing without two devices (the setup says so). Rates are of ``nbytes``."""
    from ._peerranks import expected_digests, ranks

    if devices is None or len(devices) != 2:
        report.setup["two_gpu"] = "skipped: needs a host with 2 GPUs"
        return
    fst_why = fst.missing()
    for mode, what, how in (
        ("tp", "TP=2 split on dim 0", "get_sharded"),
        ("replicate", "replicated on 2 GPUs", "get_tensor broadcast"),
    ):
        say(f"{what}: checksums of each rank's share")
        digests = expected_digests(files, 2, mode)
        key = f"{mode}2"
        label = f"{what}: tierd REST, 1 process per rank"
        say(f"{label}: {repeats} rounds")
        try:
            t, sources = ranks(
                "tierd", devices, mode, repeats, digests, {"url": url, "paths": list(relpaths)}
            )
            rate_row(report, f"{key}_tierd", label, nbytes, t, f"source: {','.join(sources)}")
        except RuntimeError as exc:
            _none(report, f"{key}_tierd", label, _failed(exc))
        label = f"{what}: {_name()} {how}, buffered, 1 process per rank"
        if fst_why is not None:
            _none(report, f"{key}_fst", label, fst_why)
            continue
        say(f"{label}: {repeats} rounds")
        files_by_rank = {k: [str(p) for i, p in enumerate(files) if i % 2 == k] for k in (0, 1)}
        try:
            t, _ = ranks(
                "fastsafetensors", devices, mode, repeats, digests, {"files": files_by_rank}
            )
            rate_row(report, f"{key}_fst", label, nbytes, t)
        except RuntimeError as exc:
            _none(report, f"{key}_fst", label, _failed(exc))
        _ratio(report, f"{key}_x", "  tierd / fastsafetensors", f"{key}_tierd", f"{key}_fst")
        free_gpu()
