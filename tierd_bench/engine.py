"""``tierd bench engine``: an inference engine's cold start, a fresh process per load.

Issue 39. An engine (vLLM, SGLang, a torchrun job) loads its weights once per process: every
figure here is a **fresh Python process**'s (:mod:`._engine_child`), from its spawn to its
first generated token, measured in that process phase by phase: the interpreter's start, the
imports of torch and transformers, the loader library's import, the CUDA context, the loader's
set-up, the model built on the meta device, the weights onto the device, and the first forward
pass. Each row also gets **the loader's part**: the time to first token less the start, torch's
and transformers' imports and the CUDA context, which every row pays alike (on an H200 the
imports took 14-18 s a process, a spread of seconds that would hide the loads).
The model is a real transformers causal LM (:mod:`._engine_model`: a Llama architecture with
random bf16 weights, written once by ``save_pretrained`` as a few safetensors shards and
cached). Rows, on the same files in one run, each the median of ``repeats`` processes:

- **from_pretrained**: ``AutoModelForCausalLM.from_pretrained(dir, device_map=device)``
  (transformers' own safetensors path; without accelerate, a cpu load and ``.to(device)``);
- **fastsafetensors**: its file loader, buffered (skipped, with the reason, when absent);
- **tierd over REST** (a server in its own process, the files on its ``nvme`` tier):
  ``Client(url).load_state_dict(model)`` into the meta-built model (``assign=True``) from the
  page cache; from the memory tier (the files prefetched into it); a **restart**: a first
  process loads with ``shared=true`` and exits, then each measured process asks
  ``shared=true`` (the kept copy), and one plain ``load_state_dict`` (issue 39's item 3);
  and from a **peer**: a second host on loopback sharing the catalog (:mod:`._engine_peer`);
- on a host with two GPUs, **replicas**: one process per GPU, started together, each its own
  replica (tierd from the memory tier, fastsafetensors each process reading every shard); the
  slowest rank is the row's. TP=2 says why it is not measured: a tensor-parallel forward needs
  a tensor-parallel model (vLLM's), which transformers' meta-built one is not (``tierd bench
  models`` measures per-rank TP loads).

Ratios are times over the reference's time (below 1 is faster): the time to first token and
the loader's part against ``from_pretrained``'s, the weights phase against fastsafetensors',
and weights + the first forward against the ceiling: the weights' bytes at the pinned host ->
device copy rate (measured in the run, on a GPU) plus the median first forward. Issue 39's
targets close the table: tierd's weights phase from the memory tier against the ceiling (at
least 0.9x) and fastsafetensors' (at least 1.8x), and tierd's lowest time to first token (and
loader's part) against the others'. Every process checks its model's every tensor against the
files after its clock stopped, and every row's first token is recorded (``first_tokens``).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ._engine_model import cached_model
from ._engine_rows import Engine, Measured, add_rows, loader_part, repeat
from ._measure import MiB, default_device, gpu_name
from ._report import BenchRow, Report, describe_device

__all__ = ["ROWS", "run"]

#: Rows that can be asked for (``--rows``); all by default.
ROWS = ("from_pretrained", "fastsafetensors", "tierd", "restart", "peer", "replicas")
NAME = "engine"  # the model's directory on the server's nvme tier
DEFAULT_GPU_SIZE = 8 * 10**9
DEFAULT_CPU_SIZE = 4 * MiB


def _cache_dir(directory: Path | None) -> Path:
    return directory or Path(tempfile.gettempdir()) / "tierd-bench-engine"


def run(
    size: int | None = None,
    device: str = "auto",
    *,
    repeats: int = 3,
    directory: Path | None = None,
    rows: Sequence[str] = ROWS,
    check: bool = True,
    catalog_url: str | None = None,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Measure an engine's cold start on every row of ``rows`` (see the module docstring).

    Parameters
    ----------
    size
        The model's weights in bytes (about): default 8 GB on a GPU, 4 MiB on ``cpu``.
    device
        ``cuda:N``, ``cpu`` or ``auto``.
    repeats
        Fresh processes per row (medians).
    directory
        Where the model is written once and kept (default: the temp dir's
        ``tierd-bench-engine``).
    rows
        Which rows to run (:data:`ROWS`).
    check
        Compare every tensor of every process's model with the files (off the clock).
    catalog_url
        The peer row's catalog: ``postgresql+psycopg://...``, in a scratch database (default:
        a throwaway local PostgreSQL).
    """
    unknown = set(rows) - set(ROWS)
    if unknown or repeats < 1:
        raise ValueError(f"rows are among {', '.join(ROWS)}; repeats at least 1")
    device = default_device() if device == "auto" else device
    size = size or (DEFAULT_GPU_SIZE if device.startswith("cuda") else DEFAULT_CPU_SIZE)
    model_dir, shape = cached_model(_cache_dir(directory), size, say)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    nbytes = int(index["metadata"]["total_size"])
    setup: dict[str, Any] = {"device": device, "gpu": gpu_name(device), "repeats": repeats}
    setup |= {"model": shape.tag, "weight_bytes": nbytes, "shape": asdict(shape)}
    report = Report(
        "engine",
        f"tierd bench engine: a fresh process to its first token, a {nbytes / 1e9:.3g} GB "
        f"bf16 Llama ({shape.layers} layers), {describe_device(setup)}, medians of {repeats}; "
        "ratios are times over the reference's (below 1: faster)",
        setup,
    )
    with tempfile.TemporaryDirectory(prefix="tierd-bench-") as tmp:
        files = _link(model_dir, Path(tmp) / "nvme" / NAME)
        engine = _engine(files, device, nbytes, check)
        _warm(files)
        measured = _measure(engine, Path(tmp), rows, repeats, setup, say, catalog_url)
    _finish(report, measured, engine, repeats, say)
    return report


def _engine(files: list[Path], device: str, nbytes: int, check: bool) -> Engine:
    import importlib.util

    from . import _fastsafetensors as fst

    has_accelerate = importlib.util.find_spec("accelerate") is not None
    return Engine(
        files[0].parent,
        files,
        device,
        nbytes,
        check=check,
        # from_pretrained's device_map needs accelerate; on cpu its default is the device.
        device_map=has_accelerate and device != "cpu",
        fst={"threads": fst._THREADS, "bbuf_kb": fst._BBUF_KB},
    )


def _link(model_dir: Path, dest: Path) -> list[Path]:
    """The model's files under ``dest`` (the server's tier): hard links, or copies across
    file systems; its safetensors shards, sorted."""
    dest.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.name.startswith("."):
            continue
        try:
            os.link(f, dest / f.name)
        except OSError:
            shutil.copyfile(f, dest / f.name)
    return sorted(dest.glob("*.safetensors"))


def _warm(files: list[Path]) -> None:
    """Read every shard once: every row starts from a hot page cache, the first included."""
    for f in files:
        with f.open("rb") as fh:
            while fh.read(64 * MiB):
                pass


def _measure(
    engine: Engine,
    tmp: Path,
    rows: Sequence[str],
    repeats: int,
    setup: dict[str, Any],
    say: Callable[[str], None],
    catalog_url: str | None = None,
) -> list[Measured]:
    from . import _engine_serve as serve

    out: list[Measured] = []
    with ExitStack() as stack:
        url = None
        if {"tierd", "restart", "replicas"} & set(rows):
            url = stack.enter_context(serve.server(tmp, engine.nbytes))
        if engine.device.startswith("cuda"):
            # The first process after a while pays for loading the CUDA libraries from disk,
            # and the server's first load for its CUDA set-up: no row should. (On cpu the
            # figures are not the point: CI runs it.)
            say("an untimed process first: the libraries' first start, the server's first load")
            engine.one(
                engine.args("tierd", url=url, name=NAME, shared=False)
                if url
                else engine.args("transformers")
            )
        out += _peers(engine, rows, repeats, say)
        if url is not None:
            out += serve.rows(engine, url, NAME, rows, repeats, say)
    if "peer" in rows:
        from ._engine_peer import peer_row

        out.append(peer_row(engine, tmp, NAME, repeats, say, catalog_url))
    setup["processes"] = {m.key: m.runs for m in out}
    return out


def _peers(
    engine: Engine, rows: Sequence[str], repeats: int, say: Callable[[str], None]
) -> list[Measured]:
    """The rows of the loaders tierd is compared with: from_pretrained, fastsafetensors."""
    from . import _fastsafetensors as fst

    out = []
    if "from_pretrained" in rows:
        m = Measured("from_pretrained", "transformers from_pretrained")
        if not engine.device_map:
            m.note = "a cpu load, then .to(device): device_map needs accelerate"
        out.append(repeat(engine, m, lambda: [engine.args("transformers")], repeats, say))
    if "fastsafetensors" in rows:
        m = Measured("fastsafetensors", "fastsafetensors, buffered")
        why = fst.missing()
        if why is None:
            m.note = f"fastsafetensors {fst.version()}"
            out.append(repeat(engine, m, lambda: [engine.args("fastsafetensors")], repeats, say))
        else:
            m.note = why
            out.append(m)
    return out


def _finish(
    report: Report,
    measured: list[Measured],
    engine: Engine,
    repeats: int,
    say: Callable[[str], None],
) -> None:
    """The rows, the pinned ceiling, the ratios, and the issue's targets on a GPU."""
    nbytes, device = engine.nbytes, engine.device
    for m in measured:
        add_rows(report, m, nbytes, device)
    forwards = [r["forward"] for m in measured for r in m.runs]
    if device.startswith("cuda") and forwards:
        from .models import _pinned_ceiling

        say("the pinned host -> device copy of the weights' size")
        _pinned_ceiling(report, device, nbytes, repeats)
        rate = report.rows["ceil_pinned_h2d"].value
        assert rate is not None
        ceiling = nbytes / (rate * 1e9) + statistics.median(forwards)
        label = "ceiling: the weights at the pinned copy's rate + the first forward (median)"
        report.add(BenchRow("ceiling", label, ceiling, "s"))
    tokens = {m.key: sorted({r["token"] for r in m.runs}) for m in measured if m.runs}
    report.setup["first_tokens"] = tokens
    if len({t for ts in tokens.values() for t in ts}) > 1:
        report.setup["first_tokens_note"] = "the rows' first tokens differ"
    for m in measured:
        if m.key != "from_pretrained":
            report.compare(m.key, "from_pretrained")
            report.compare(f"{m.key}_load", "from_pretrained_load")
        if m.key != "fastsafetensors":
            report.compare(f"{m.key}_weights", "fastsafetensors_weights")
        report.compare(f"{m.key}_wf", "ceiling")
    _targets(report, measured)


def _targets(report: Report, measured: list[Measured]) -> None:
    """Issue 39's figures: tierd's weights from the memory tier against the ceiling and
    fastsafetensors, and whether tierd's rows have the lowest time to first token."""

    def speedup(key: str, label: str, slow: str, fast: str, at_least: float) -> None:
        a, b = report.rows.get(slow), report.rows.get(fast)
        if a is None or b is None or not a.value or not b.value:
            return
        ratio = a.value / b.value
        report.add(BenchRow(key, label, ratio, "x", target=f">= {at_least:g}x"))
        report.rows[key].met = ratio >= at_least

    if "ceil_pinned_h2d" in report.rows and "memory_weights" in report.rows:
        rate = report.rows["ceil_pinned_h2d"].value
        assert rate is not None
        t = report.setup["weight_bytes"] / (rate * 1e9)
        report.add(BenchRow("ceiling_weights", "the weights at the pinned copy's rate", t, "s"))
        speedup(
            "target_memory_vs_ceiling",
            "tierd memory tier's weights phase, ceiling time / its time",
            "ceiling_weights",
            "memory_weights",
            0.9,
        )
    speedup(
        "target_memory_vs_fst",
        "tierd memory tier's weights phase, fastsafetensors' time / its time",
        "fastsafetensors_weights",
        "memory_weights",
        1.8,
    )
    one_gpu = [m for m in measured if m.runs and not m.key.startswith("replicas")]
    for key, what, figure in (
        ("target_lowest_ttft", "time to first token", lambda m: m.median("ttft")),
        ("target_lowest_load", "loader's part", lambda m: _median_load(m)),
    ):
        tierd = [figure(m) for m in one_gpu if m.key not in _PEERS]
        others = [figure(m) for m in one_gpu if m.key in _PEERS]
        if tierd and others:
            ratio = min(tierd) / min(others)
            label = f"tierd's lowest {what} / the others' lowest"
            row = report.add(BenchRow(key, label, ratio, "x", target="< 1x"))
            row.met = ratio < 1


def _median_load(m: Measured) -> float:
    return statistics.median(loader_part(r) for r in m.runs)


_PEERS = ("from_pretrained", "fastsafetensors")
