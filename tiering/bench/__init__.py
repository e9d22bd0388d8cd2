"""``tierd bench``: this host's ceilings and tierd's paths measured side by side in one run.

Sub-benchmarks import lazily: the data-path one needs only :mod:`tiering.io`."""

from tiering.bench.data_path import BenchRow, parse_size, render, run_bench

__all__ = ["BenchRow", "parse_size", "render", "run_bench"]
