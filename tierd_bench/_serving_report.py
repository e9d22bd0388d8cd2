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

#: The phases a window can be in: no background work, files moving, files filling from a peer,
#: a large load streaming.
PHASES = ("idle", "moves", "fills", "load")
#: Targets (issue 43): p99 at most these times idle's, per busy phase (none for fills: the issue
#: sets none); rate at least 0.8x idle's while moving; a move at most 1.5x its time alone.
P99_AT_MOST = {"moves": 1.5, "load": 3.0}
RATE_AT_LEAST = 0.8
MOVE_SLOWDOWN_AT_MOST = 1.5
_LABEL = {
    "idle": "idle",
    "moves": "while files move",
    "fills": "while files fill from a peer",
    "load": "during a large load",
}
#: The background work's spans: (phase, RunResult's field busy, its field alone, row key stem).
_WORK = (
    ("moves", "moves", "alone", "move_s"),
    ("fills", "fills", "fills_alone", "fill_s"),
    ("load", "loads", "loads_alone", "load_s"),
)
#: Their rows: what the seconds are of, and the target of the slowdown.
_SPANS = {
    "moves": ("a move takes", MOVE_SLOWDOWN_AT_MOST),
    "fills": ("a fill from the peer takes", None),
    "load": ("of the large load", None),
}


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
    (``time.monotonic()`` start and end of each move, fill and load)."""

    windows: list[Window]
    samples: list[Sample]
    moves: list[tuple[float, float]] = field(default_factory=list)
    alone: list[tuple[float, float]] = field(default_factory=list)  # moves with no client
    loads: list[tuple[float, float]] = field(default_factory=list)
    loads_alone: list[tuple[float, float]] = field(default_factory=list)
    fills: list[tuple[float, float]] = field(default_factory=list)
    fills_alone: list[tuple[float, float]] = field(default_factory=list)
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
    for phase, spans, spans_alone, stem in _WORK:
        done, done_alone = getattr(res, spans), getattr(res, spans_alone)
        if phase in phases or done_alone:
            alone = _median([b - a for a, b in done_alone])
            busy = _median(_spans_in(done, phases.get(phase, [])))
            out[f"{stem}_alone"] = (alone, None)
            out[f"{stem}_{phase}"] = (busy, _ratio(busy, alone))
    out["loadavg"] = (res.loadavg[1], None)
    return out


def _rows(phases: list[str]) -> list[tuple[str, str, str, tuple[str, float] | None]]:
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
            most = P99_AT_MOST.get(p) if busy and key in ("read_4k_p99", "all_p99") else None
            target = None if most is None else ("<=", most)
            rows.append((f"{key}_{p}_ms", f"{what}, {_LABEL[p]}", "ms", target))
        rate_target = (">=", RATE_AT_LEAST) if p == "moves" else None
        rows.append(
            (f"rate_{p}", f"requests completed per second, {_LABEL[p]}", "req/s", rate_target)
        )
        rows.append((f"server_cpu_{p}", f"server CPU, {_LABEL[p]}", "cores", None))
        rows.append((f"client_cpu_{p}", f"client processes' CPU, {_LABEL[p]}", "cores", None))
    for phase, _, _, stem in _WORK:
        if phase in phases:
            what, most = _SPANS[phase]
            rows.append((f"{stem}_alone", f"seconds {what}, no client", "s", None))
            target = None if most is None else ("<=", most)
            rows.append((f"{stem}_{phase}", f"seconds {what}, serving", "s", target))
    rows.append(("loadavg", "the host's 1-minute load average, each run's end", "", None))
    return rows


def _fmt(v: float | None, unit: str, ratio: bool) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}x" if ratio else f"{v:.3g}{(' ' + unit) if unit else ''}"


def _busy_titles(setup: dict[str, Any]) -> list[str]:
    """What each busy phase of ``setup`` does, for the title."""
    busy = setup.get("phases", ["moves"] + (["load"] if setup.get("load") else []))
    out = []
    if "moves" in busy:
        cap = setup.get("cap_bytes_per_s")
        out.append(
            f"while {setup['movers']} files of {format_size(setup['move_size_bytes'])} move "
            f"between tiers ({f'capped at {cap / MiB:g} MiB/s' if cap else 'no cap'})"
        )
    if "fills" in busy:
        fills = setup["fills"]
        out.append(
            f"while {fills['fillers']} files of {format_size(fills['size_bytes'])} fill from a "
            "peer's pieces"
        )
    if "load" in busy:
        load = setup["load"]
        out.append(
            f"during loads of {format_size(load['size_bytes'])} from the {load['origin']} "
            f"origin into {load['device']}"
        )
    return out or ["nothing busy"]


def build_report(setup: dict[str, Any], runs: list[RunResult]) -> Report:
    """One report from ``runs``: medians, targets met by every run, each run in the notes."""
    report = Report(
        "serving",
        f"tierd bench serving: {setup['clients']} client processes over REST, idle vs "
        + " and ".join(_busy_titles(setup))
        + f"; {setup['repeats']} rounds of {setup['duration_s']:g} s windows, "
        f"{len(runs)} run{'s' if len(runs) > 1 else ''} (medians)",
        setup,
    )
    figs = [figures(r) for r in runs]
    phases = [p for p in PHASES if any(f"rate_{p}" in f for f in figs)]
    ref = {phase: f"{stem}_alone" for phase, _, _, stem in _WORK}
    stems = tuple(stem for *_, stem in _WORK)
    for key, label, unit, target in _rows(phases):
        values = [v for f in figs if key in f and (v := f[key][0]) is not None]
        ratios = [r for f in figs if key in f and (r := f[key][1]) is not None]
        row = report.add(BenchRow(key, label, _median(values), unit))
        if ratios:
            phase = key.rsplit("_", 2)[-2] if key.endswith("_ms") else key.rsplit("_", 1)[-1]
            row.vs = ref.get(phase) if key.startswith(stems) else None
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
