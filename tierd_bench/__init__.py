"""``tierd bench``: this host's ceilings and tierd's paths, measured side by side in one run.

Sub-benchmarks, each a module with one entry point that returns a :class:`Report`:

- :mod:`.data_path` (``tierd bench``, ``tierd bench data``): files into GPU or host memory;
- :mod:`.access` (``tierd bench access``): access counting and its cost to reads;
- :mod:`.mover` (``tierd bench mover``): the migration copy path against ``cp``;
- :mod:`.rest` (``tierd bench rest``): loads over REST against in-process reads;
- :mod:`.serving` (``tierd bench serving``): requests served while files move between tiers.

This package itself exports only the shared result model, table and JSON writer, so importing
it needs neither CUDA, torch, a catalog nor a server; import a sub-benchmark to run it.
"""

from __future__ import annotations

from ._measure import format_size, parse_size
from ._report import BenchRow, Report, print_report, progress, render, write_json

__all__ = [
    "BenchRow",
    "Report",
    "format_size",
    "parse_size",
    "print_report",
    "progress",
    "render",
    "write_json",
]
