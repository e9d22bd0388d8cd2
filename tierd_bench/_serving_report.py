"""The figures of ``tierd bench serving`` (:mod:`tierd_bench.serving`): one run's windows and
samples made into figures, and several runs' figures into one report of medians.

Within a run, latencies pool the requests of every window of a phase (one window holds too few
for a steady p99, let alone a p999); a phase's request rate is the median of its windows, and
a rate ratio the median of each busy window's rate over the idle window just before it.
Across runs, a row's value and ratio are the medians of the runs', and a target is met only
when every run met it (issue 43: "in each of three runs"); the note lists each run's figure.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from ._measure import MiB, format_size, percentile
from ._report import BenchRow, Report
from ._serving_clients import KINDS, Sample

__all__ = ["PHASES", "RunResult", "Window", "build_report"]

#: The phases a window can be in: no background work, files moving, a large load streaming.
PHASES = ("idle", "moves", "load")
#: Targets (issue 43): p99 at most these times idle's, per busy phase; rate at least 0.8x
#: idle's while moving; a move at most 1.5x its time alone.
P99_AT_MOST = {"moves": 1.5, "load": 3.0}
RATE_AT_LEAST = 0.8
MOVE_SLOWDOWN_AT_MOST = 1.5
_LABEL = {"idle": "idle", "moves": "while files move", "load": "during a large load"}


@dataclass
class Window:
    phase: str
    t0: float
    t1: float = 0.0
    server_cpu: float = 0.0
    client_cpu: float = 0.0
    requests: int = 0  # completed, from the clients' counters (the progress line's figure)

    @property
    def rate(self) -> float:
        return self.requests / (self.t1 - self.t0)


@dataclass
class RunResult:
    """What one run measured: windows, the clients' samples, and the background work's spans
    (``time.monotonic()`` start and end of each move and each load)."""

    windows: list[Window]
    samples: list[Sample]
    moves: list[tuple[float, float]] = field(default_factory=list)
    alone: list[tuple[float, float]] = field(default_factory=list)  # moves with no client
    loads: list[tuple[float, float]] = field(default_factory=list)
    loads_alone: list[tuple[float, float]] = field(default_factory=list)
    loadavg: tuple[float, float] = (0.0, 0.0)  # the host's 1-minute load, at start and end


#: One run's figures: row key -> (value, ratio or None).
Figures = dict[str, tuple[float | None, float | None]]


def _inside(w: Window, samples: list[Sample]) -> list[Sample]:
    return [s for s in samples if s.t0 >= w.t0 and s.t1 <= w.t1]


def _rate_of(w: Window, samples: list[Sample]) -> float:
    return sum(1 for s in samples if w.t0 <= s.t1 < w.t1) / (w.t1 - w.t0)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _spans_in(spans: list[tuple[float, float]], ws: list[Window]) -> list[float]:
    """Seconds of the spans that lie wholly inside one of ``ws``."""
    return [b - a for a, b in spans if any(w.t0 <= a and b <= w.t1 for w in ws)]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def figures(res: RunResult) -> Figures:
    """One run's figures (see the module docstring)."""
    out: Figures = {}
    phases = {p: [w for w in res.windows if w.phase == p] for p in PHASES}
    phases = {p: ws for p, ws in phases.items() if ws}
    for p, ws in phases.items():
        pooled = [s for w in ws for s in _inside(w, res.samples)]
        for k, name in ((None, "all"), *((k, kind[0]) for k, kind in enumerate(KINDS))):
            ms = [s.seconds * 1e3 for s in pooled if k is None or s.kind == k]
            qs = (50, 99, 99.9) if name == "read_4k" else (99,)
            for q in qs:
                key = f"{name}_p{q:g}_{p}_ms".replace(".", "")
                out[key] = (percentile(ms, q) if ms else None, None)
            out[f"{name}_n_{p}"] = (float(len(ms)), None)
        out[f"rate_{p}"] = (_median([_rate_of(w, res.samples) for w in ws]), None)
        for who in ("server", "client"):
            cores = [getattr(w, f"{who}_cpu") / (w.t1 - w.t0) for w in ws]
            out[f"{who}_cpu_{p}"] = (_median(cores), None)
    for p in phases.keys() - {"idle"}:
        for key in [k for k in out if k.endswith(f"_{p}_ms")]:
            idle_key = key.replace(f"_{p}_ms", "_idle_ms")
            out[key] = (out[key][0], _ratio(out[key][0], out.get(idle_key, (None,))[0]))
        # Each busy window over the idle window just before it.
        pairs = [
            _rate_of(b, res.samples) / _rate_of(a, res.samples)
            for a, b in zip(res.windows, res.windows[1:], strict=False)
            if a.phase == "idle" and b.phase == p and _rate_of(a, res.samples) > 0
        ]
        out[f"rate_{p}"] = (out[f"rate_{p}"][0], _median(pairs))
    alone = _median([b - a for a, b in res.alone])
    busy = _median(_spans_in(res.moves, phases.get("moves", [])))
    out["move_s_alone"] = (alone, None)
    out["move_s_moves"] = (busy, _ratio(busy, alone))
    if res.loads_alone or res.loads:
        alone = _median([b - a for a, b in res.loads_alone])
        busy = _median(_spans_in(res.loads, phases.get("load", [])))
        out["load_s_alone"] = (alone, None)
        out["load_s_load"] = (busy, _ratio(busy, alone))
    out["loadavg"] = (res.loadavg[1], None)
    return out


def _rows(
    phases: list[str], has_load: bool
) -> list[tuple[str, str, str, tuple[str, float] | None]]:
    """(key, label, unit, target) of every row, in print order."""
    rows: list[tuple[str, str, str, tuple[str, float] | None]] = []
    for p in phases:
        busy = p != "idle"
        for key, what in (
            ("read_4k_p50", "read_4k, p50"),
            ("read_4k_p99", "read_4k, p99"),
            ("read_4k_p999", "read_4k, p99.9"),
            ("all_p99", "every request, p99"),
            ("load_4k_p99", "load_4k, p99"),
            ("load_1m_p99", "load_1m, p99"),
        ):
            target = ("<=", P99_AT_MOST[p]) if busy and key in ("read_4k_p99", "all_p99") else None
            rows.append((f"{key}_{p}_ms", f"{what}, {_LABEL[p]}", "ms", target))
        rate_target = (">=", RATE_AT_LEAST) if p == "moves" else None
        rows.append(
            (f"rate_{p}", f"requests completed per second, {_LABEL[p]}", "req/s", rate_target)
        )
        rows.append((f"server_cpu_{p}", f"server CPU, {_LABEL[p]}", "cores", None))
        rows.append((f"client_cpu_{p}", f"client processes' CPU, {_LABEL[p]}", "cores", None))
    rows.append(("move_s_alone", "seconds a move takes, no client", "s", None))
    rows.append(
        ("move_s_moves", "seconds a move takes, serving", "s", ("<=", MOVE_SLOWDOWN_AT_MOST))
    )
    if has_load:
        rows.append(("load_s_alone", "seconds of the large load, no client", "s", None))
        rows.append(("load_s_load", "seconds of the large load, serving", "s", None))
    rows.append(("loadavg", "the host's 1-minute load average, each run's end", "", None))
    return rows


def _fmt(v: float | None, unit: str, ratio: bool) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}x" if ratio else f"{v:.3g}{(' ' + unit) if unit else ''}"


def build_report(setup: dict[str, Any], runs: list[RunResult]) -> Report:
    """One report from ``runs``: medians, targets met by every run, each run in the notes."""
    cap = setup.get("cap_bytes_per_s")
    load = setup.get("load")
    report = Report(
        "serving",
        f"tierd bench serving: {setup['clients']} client processes over REST, idle vs while "
        f"{setup['movers']} files of {format_size(setup['move_size_bytes'])} move between "
        f"tiers ({f'capped at {cap / MiB:g} MiB/s' if cap else 'no cap'})"
        + (
            f" and during loads of {format_size(load['size_bytes'])} from the {load['origin']} "
            f"origin into {load['device']}"
            if load
            else ""
        )
        + f"; {setup['repeats']} rounds of {setup['duration_s']:g} s windows, "
        f"{len(runs)} run{'s' if len(runs) > 1 else ''} (medians)",
        setup,
    )
    figs = [figures(r) for r in runs]
    phases = [p for p in PHASES if any(f"rate_{p}" in f for f in figs)]
    ref = {"moves": "move_s_alone", "load": "load_s_alone"}
    for key, label, unit, target in _rows(phases, load is not None):
        values = [v for f in figs if key in f and (v := f[key][0]) is not None]
        ratios = [r for f in figs if key in f and (r := f[key][1]) is not None]
        row = report.add(BenchRow(key, label, _median(values), unit))
        if ratios:
            phase = key.rsplit("_", 2)[-2] if key.endswith("_ms") else key.rsplit("_", 1)[-1]
            row.vs = ref.get(phase) if key.startswith(("move_s", "load_s")) else None
            row.vs = row.vs or key.replace(f"_{phase}", "_idle")
            row.ratio = _median(ratios)
            if target is not None:
                op, x = target
                row.target = f"{op} {x:g}x"
                row.met = all((r <= x) if op == "<=" else (r >= x) for r in ratios)
            row.note = "runs: " + ", ".join(_fmt(r, "", True) for r in ratios)
        elif len(values) > 1:
            row.note = "runs: " + ", ".join(_fmt(v, unit, False) for v in values)
        if key.endswith("_ms"):
            count = key.split("_p")[0] + "_n_" + key.rsplit("_", 2)[-2]
            n = _median([float(f[count][0] or 0) for f in figs if count in f])
            if n:
                row.note = f"{row.note} ({n:.0f} requests a run)".strip()
    return report
