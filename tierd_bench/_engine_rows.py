"""The processes of ``tierd bench engine`` and the table rows made of them.

A *row* is one way an engine gets its weights (``from_pretrained``, fastsafetensors, tierd
from the page cache...). Each repeat of a row starts fresh processes (:mod:`._engine_child`),
one, or one per GPU started together; a row's figure for each phase is the median over its
repeats of the slowest process's (an engine serves when its last rank is ready). Where the
weights came from, for tierd's rows, is read from the server's ``tierd_loads_by_source_total``
before and after the processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from ._measure import gbps
from ._report import BenchRow, Report

__all__ = [
    "PHASES",
    "Engine",
    "EngineProcessFailed",
    "Measured",
    "add_rows",
    "loader_part",
    "repeat",
    "sources",
]

#: The phases of one process, in order (see :mod:`._engine_child`).
PHASES = (
    "startup",
    "imports",
    "loader_import",
    "cuda",
    "setup",
    "construct",
    "weights",
    "forward",
)
_LABELS = {
    "startup": "interpreter start",
    "imports": "imports: torch, transformers",
    "loader_import": "import of the loader's library",
    "cuda": "CUDA context",
    "setup": "the loader's set-up (client, file loader)",
    "construct": "model on the meta device",
    "weights": "weights onto the device",
    "forward": "first forward pass + argmax",
}
_CHILD = Path(__file__).with_name("_engine_child.py")
# Runs the child's file without importing tierd_bench (and rich) before its clock starts.
_BOOT = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
_TIMEOUT_S = 1800


class EngineProcessFailed(RuntimeError):
    """An engine process exited with an error (its standard error is in the message)."""


@dataclass
class Engine:
    """What every engine process of one run is given: the model, its files, the device."""

    model_dir: Path
    files: list[Path]
    device: str
    nbytes: int
    check: bool = True
    device_map: bool = True
    fst: dict[str, int] = field(default_factory=dict)

    def args(self, loader: str, device: str | None = None, **extra: Any) -> dict[str, Any]:
        """One process's JSON argument."""
        return {
            "loader": loader,
            "device": device or self.device,
            "model_dir": str(self.model_dir),
            "files": [str(f) for f in self.files],
            "check": self.check,
            "device_map": self.device_map,
            **{f"fst_{k}": v for k, v in self.fst.items()},
            **extra,
        }

    def together(self, many: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Start one process per argument at once (as an engine starts its ranks) and wait
        for all; each one's phases."""
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path]),
            "FASTSAFETENSORS_ODIRECT": "0",  # buffered, as the figures: see the row
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "TOKENIZERS_PARALLELISM": "false",
        }
        # Output to files, not pipes: a process blocked on a full pipe while this one waits
        # on another would be timed waiting.
        with contextlib.ExitStack() as stack:
            procs = []
            for args in many:
                out, err = (stack.enter_context(tempfile.TemporaryFile()) for _ in range(2))
                cmd = [sys.executable, "-c", _BOOT, str(_CHILD)]
                cmd.append(json.dumps({**args, "spawn": time.time()}))
                procs.append((subprocess.Popen(cmd, stdout=out, stderr=err, env=env), out, err))
            try:
                return [_result(p, out, err) for p, out, err in procs]
            finally:
                for p, _, _ in procs:  # after a failure: the others are not left running
                    if p.poll() is None:
                        p.kill()
                        p.wait()

    def one(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.together([args])[0]


def _result(p: subprocess.Popen[bytes], out: IO[bytes], err: IO[bytes]) -> dict[str, Any]:
    """The phases process ``p`` printed, once it has exited (its output in ``out``, ``err``)."""
    p.wait(timeout=_TIMEOUT_S)
    out.seek(0)
    err.seek(0)
    if p.returncode != 0:
        tail = err.read().decode(errors="replace").strip()[-3000:]
        raise EngineProcessFailed(f"an engine process exited with {p.returncode}: {tail}")
    seen: dict[str, Any] = json.loads(out.read().decode().strip().splitlines()[-1])
    return seen


_SERIES = re.compile(r"^tierd_loads_by_source_total\{([^}]*)\}\s+(\S+)", re.MULTILINE)


def sources(url: str, token: str | None = None) -> Counter[str]:
    """Loads the server at ``url`` has completed, by ``source`` (its ``/metrics``)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    out: Counter[str] = Counter()
    for labels, value in _SERIES.findall(text):
        m = re.search(r'source="([^"]*)"', labels)
        if m:
            out[m.group(1)] += int(float(value))
    return out


@dataclass
class Measured:
    """A row's processes: per repeat, the slowest process's phases."""

    key: str
    label: str
    runs: list[dict[str, Any]] = field(default_factory=list)
    sources: Counter[str] = field(default_factory=Counter)
    note: str = ""

    def add(self, procs: list[dict[str, Any]]) -> None:
        self.runs.append(max(procs, key=lambda p: float(p["ttft"])))

    def median(self, phase: str) -> float | None:
        values = [r[phase] for r in self.runs if r.get(phase) is not None]
        return statistics.median(values) if values else None


def repeat(
    engine: Engine,
    m: Measured,
    procs: Callable[[], list[dict[str, Any]]],
    repeats: int,
    say: Callable[[str], None],
    *,
    url: str | None = None,
    token: str | None = None,
) -> Measured:
    """``repeats`` runs of row ``m``, each of the processes ``procs()`` started together;
    with ``url``, the server's loads by source during them."""
    say(f"{m.label}: {repeats} x {len(procs())} fresh process(es)")
    before = sources(url, token) if url else None
    for _ in range(repeats):
        m.add(engine.together(procs()))
    if url and before is not None:
        m.sources = sources(url, token) - before
    return m


def add_rows(report: Report, m: Measured, nbytes: int, device: str) -> None:
    """Row ``m``'s figures: its time to first token, then each phase's median."""
    k = m.key
    where = ", ".join(f"{s} {n}" for s, n in sorted(m.sources.items()))
    note = "; ".join(x for x in (m.note, f"tierd loads by source: {where}" if where else "") if x)
    if not m.runs:
        report.add(BenchRow(k, f"{m.label}: start -> first token", None, "s", note=note))
        return
    report.add(BenchRow(k, f"{m.label}: start -> first token", m.median("ttft"), "s", note=note))
    for phase in PHASES:
        value = m.median(phase)
        if value is None:
            continue
        label = _LABELS[phase].replace("the device", device)
        row = report.add(BenchRow(f"{k}_{phase}", f"  {label}", value, "s"))
        if phase == "weights":
            row.note = f"{gbps(nbytes, value):.2f} GB/s"
    wf = [r["weights"] + r["forward"] for r in m.runs]
    report.add(BenchRow(f"{k}_wf", "  weights + first forward", statistics.median(wf), "s"))
    label = "  the loader's part: its import, set-up, the model, weights, first forward"
    report.add(BenchRow(f"{k}_load", label, statistics.median(map(loader_part, m.runs)), "s"))


def loader_part(run: dict[str, Any]) -> float:
    """What differs between loaders in one process: the time to the first token less the
    interpreter's start, torch's and transformers' imports and the CUDA context, which every
    row pays alike (and whose spread, seconds on a GPU host, would hide the loads')."""
    parts = ("loader_import", "setup", "construct", "weights", "forward")
    return sum(float(run[p] or 0.0) for p in parts)
