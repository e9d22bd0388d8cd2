"""One result model for every ``tierd bench`` sub-benchmark, printed as a table and as JSON.

A :class:`Report` holds :class:`BenchRow` figures. A row may name another row of the same run
as its reference (``vs``), and then carries the ratio of the two, because ratios are only
meaningful within one run on one machine. It may also carry a target and whether it was met.
Every sub-benchmark returns a Report, so they all print the same table and write the same
JSON::

    {"bench": "data", "title": "...",
     "machine": {"platform": ..., "cpus": ..., "memory_bytes": ..., "time": ...},
     "setup": {what this run was asked to do and what it found: device, backend, sizes...},
     "rows": {"tierd_hot": {"key": "tierd_hot", "label": "tierd load, hot", "value": 47.9,
                            "unit": "GB/s", "vs": "ceil_pinned_h2d", "ratio": 0.88,
                            "target": ">= 0.9x", "met": false,
                            "note": "..."}, ...}}

Tables go to logs and CI as often as to terminals. Off a terminal, rich would assume 80
columns and fold every cell into fragments, so :func:`print_report` prints at the table's
natural width there instead.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

__all__ = [
    "BenchRow",
    "Report",
    "cpu_row",
    "describe_device",
    "describe_machine",
    "format_value",
    "print_report",
    "progress",
    "render",
    "write_json",
]

COLUMNS = ("measure", "value", "reference", "ratio", "target", "met", "note")


@dataclass
class BenchRow:
    """One measured figure, optionally compared with another row of the run and a target."""

    key: str
    label: str
    value: float | None
    unit: str
    vs: str | None = None
    ratio: float | None = None
    target: str | None = None
    met: bool | None = None
    note: str = ""


def cpu_row(key: str, label: str, cpu_s: float, nbytes: int) -> BenchRow:
    """The CPU cost of row ``key`` (``label``), which moved ``nbytes`` using ``cpu_s`` CPU
    seconds: a row of its own beside it, ``<key>_cpu`` in CPU-s/GB, so that CPU figures can be
    compared and held to targets like any other."""
    return BenchRow(f"{key}_cpu", f"  CPU cost of {label}", cpu_s / (nbytes / 1e9), "CPU-s/GB")


def _finite(value: Any) -> Any:
    # NaN and infinity are not JSON: a figure that could not be taken is null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or None


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not every platform names these
        return None


def describe_machine() -> dict[str, Any]:
    """What a reader needs to compare two runs: the host, its size, the software, the time."""
    try:
        version: str | None = metadata.version("tierd")
    except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        version = None
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": _memory_bytes(),
        "python": platform.python_version(),
        "tierd": version,
        "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def describe_device(setup: dict[str, Any]) -> str:
    """``cuda:0 (NVIDIA H100 80GB HBM3)`` or ``cpu``, from a setup's ``device`` and ``gpu``."""
    gpu = setup.get("gpu")
    return f"{setup['device']} ({gpu})" if gpu else str(setup["device"])


@dataclass
class Report:
    """The figures of one sub-benchmark run, with the machine and setup they were taken on."""

    bench: str
    title: str
    setup: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=describe_machine)
    rows: dict[str, BenchRow] = field(default_factory=dict)

    def add(self, row: BenchRow) -> BenchRow:
        """Add (or replace) ``row``; rows print in the order they were first added."""
        self.rows[row.key] = row
        return row

    def compare(
        self,
        key: str,
        vs: str,
        at_least: float | None = None,
        *,
        at_most: float | None = None,
    ) -> None:
        """Set ``key``'s ratio to row ``vs``; with ``at_least`` (or ``at_most``, for figures
        where lower is better, such as latencies), also its target and verdict.

        Does nothing when either figure is missing (a peer not installed, a skipped cold run),
        so callers may compare unconditionally.
        """
        row, ref = self.rows.get(key), self.rows.get(vs)
        if row is None or ref is None or row.value is None or not ref.value:
            return
        row.vs, row.ratio = vs, row.value / ref.value
        # The reference is named in its own column; the target needs only the factor.
        if at_least is not None:
            row.target = f">= {at_least:g}x"
            row.met = row.ratio >= at_least
        elif at_most is not None:
            row.target = f"<= {at_most:g}x"
            row.met = row.ratio <= at_most

    def as_dict(self) -> dict[str, Any]:
        """The JSON document :func:`write_json` writes (see the module docstring)."""
        doc = {
            "bench": self.bench,
            "title": self.title,
            "machine": self.machine,
            "setup": self.setup,
            "rows": {k: asdict(v) for k, v in self.rows.items()},
        }
        result: dict[str, Any] = _finite(doc)
        return result


def format_value(value: float | None, unit: str) -> str:
    """``48.90 GB/s``, ``1,912,345 /s``, ``0.0031 GB/s``: digits that matter at any scale."""
    if value is None:
        return "-"
    if abs(value) >= 1000:
        text = f"{value:,.0f}"
    elif abs(value) >= 1 or value == 0:
        text = f"{value:.2f}"
    else:
        text = f"{value:.3g}"
    return f"{text} {unit}".strip()


def render(report: Report) -> Table:
    """The rows of ``report`` as a rich Table (title and machine are printed above it).

    Columns no row fills (no targets in a run, say) are left out: narrower is more readable.
    """
    cells = []
    for row in report.rows.values():
        ref = report.rows.get(row.vs) if row.vs else None
        cells.append(
            (
                row.label,
                format_value(row.value, row.unit),
                f"{ref.label}: {format_value(ref.value, ref.unit)}" if ref else "",
                f"{row.ratio:.2f}x" if row.ratio is not None else "",
                row.target or "",
                {True: "yes", False: "NO", None: ""}[row.met],
                row.note,
            )
        )
    keep = [i for i, _ in enumerate(COLUMNS) if i < 2 or any(c[i] for c in cells)]
    table = Table()
    for i in keep:
        # Fold rather than crop on a narrow terminal: a cut-off figure would read as another.
        table.add_column(COLUMNS[i], overflow="fold")
    for c in cells:
        # Text, not markup: an error quoted in a note ("[/src/pair.cc:553]") is not rich markup.
        table.add_row(*(Text(c[i]) for i in keep))
    return table


def _machine_line(machine: dict[str, Any]) -> str:
    parts = [str(machine.get("platform"))]
    cpus = f"{machine.get('cpus')} CPUs"
    if machine.get("cpu_model"):
        cpus += f" ({machine['cpu_model']})"
    parts.append(cpus)
    if machine.get("memory_bytes"):
        parts.append(f"{machine['memory_bytes'] / (1 << 30):.1f} GiB RAM")
    parts.append(f"Python {machine.get('python')}")
    if machine.get("tierd"):
        parts.append(f"tierd {machine['tierd']}")
    parts.append(str(machine.get("time")))
    return "machine: " + ", ".join(parts)


def _natural_width(console: Console, table: Table) -> int:
    # What the table would take with room to spare: every cell on one line.
    return Measurement.get(console, console.options.update_width(1 << 16), table).maximum


def print_report(report: Report, file: TextIO | None = None) -> None:
    """Print ``report``'s title, machine and table to ``file`` (default: standard output).

    On a terminal the table fits the terminal's width. Anywhere else (a log, CI, ``| tee``)
    it is printed at its natural width, one line per row, however wide that is: a reader of a
    log can scroll sideways but cannot put folded fragments back together.
    """
    console = Console(file=file, highlight=False)
    table = render(report)
    if not console.is_terminal:
        console.width = max(80, _natural_width(console, table))
    # soft_wrap: long header lines run on rather than being broken at the console's width.
    console.print(Text(report.title, style="bold"), soft_wrap=True)
    console.print(Text(_machine_line(report.machine)), soft_wrap=True)
    console.print(table)


def write_json(report: Report, path: Path) -> None:
    """Write ``report`` as the JSON document of the module docstring to ``path``."""
    path.write_text(json.dumps(report.as_dict(), indent=2) + "\n")


def progress(file: TextIO | None = None) -> Callable[[str], None]:
    """A ``say`` for benchmarks: progress lines to standard error (or ``file``), never wrapped,
    so that standard output holds only the table."""
    console = Console(file=file, stderr=file is None, highlight=False)

    def say(line: str) -> None:
        console.print(line, markup=False, soft_wrap=True)

    return say
