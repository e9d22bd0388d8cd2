"""The options of ``tierd bench``'s sub-commands (:mod:`.cli`, :mod:`._clifleet`), declared
once as types, and the parsing they share; the commands themselves are in :mod:`.cli`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from ._measure import format_size, parse_size
from ._report import Report, print_report, write_json

__all__ = [
    "ColdOpt",
    "ConnectionsOpt",
    "DeviceOpt",
    "DirOpt",
    "JsonOpt",
    "ObjectsOpt",
    "OriginOpt",
    "RateOpt",
    "RepeatsOpt",
    "RowsOpt",
    "SamplesOpt",
    "ShardsOpt",
    "SizeOpt",
    "SweepOpt",
    "_finish",
    "_finish_on_origin",
    "_rate",
    "_size",
]

# -- options shared by several sub-benchmarks ---------------------------------------------------
RepeatsOpt = Annotated[
    int, typer.Option("--repeats", "--repeat", help="Timed runs per figure (median).", min=1)
]
DeviceOpt = Annotated[
    str, typer.Option("--device", help="cuda:N, cpu, or auto (a GPU when there is one).")
]
# -- the data-path bench's ---------------------------------------------------------------------
SizeOpt = Annotated[str, typer.Option("--size", help="Test file size, e.g. 4GiB, 512MiB, 1G.")]
DirOpt = Annotated[
    Path | None,
    typer.Option("--dir", help="Where to write test files (not tmpfs). Default: here."),
]
RowsOpt = Annotated[int, typer.Option("--rows", help="Rows per random gather.", min=1)]
ShardsOpt = Annotated[
    int, typer.Option("--shards", help="safetensors shards for the multi-shard load.", min=1)
]
ColdOpt = Annotated[bool, typer.Option("--cold/--no-cold", help="Measure cold-cache figures too.")]
SweepOpt = Annotated[
    bool, typer.Option("--sweep", help="Also sweep threads x task size for hot loads.")
]
# -- the object-store bench's ------------------------------------------------------------------
OriginOpt = Annotated[
    str,
    typer.Option(
        "--origin",
        help="S3 origin started on loopback: moto, s3like (nginx, --rate per connection), "
        "open (nginx, no cap), or an endpoint http(s)://host[:port]/bucket (AWS credentials).",
    ),
]
ObjectsOpt = Annotated[
    int, typer.Option("--objects", help="Tiny objects adopted by the adoption figure.", min=1)
]
ConnectionsOpt = Annotated[
    int | None,
    typer.Option(
        "--connections",
        help="Requests in flight of the s3 tier (its connections) and of every peer alike; "
        "default: the tier's own (64), 64 for the peers.",
        min=1,
        max=1024,
    ),
]
SamplesOpt = Annotated[
    int, typer.Option("--samples", help="4 KiB reads per latency figure (p50, p99).", min=1)
]
JsonOpt = Annotated[
    Path | None,
    typer.Option("--json", "--out", help="Also write the results as JSON to this file."),
]
RateOpt = Annotated[
    str, typer.Option("--rate", help="Per-connection cap of the s3like origin, bytes/s (100MB).")
]


def _size(text: str, minimum: int = 1) -> int:
    try:
        nbytes = parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--size") from exc
    if nbytes < minimum:
        raise typer.BadParameter(f"must be at least {format_size(minimum)}", param_hint="--size")
    return nbytes


def _rate(text: str) -> int | None:
    try:
        rate = parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--rate") from exc
    return rate or None


def _finish(report: Report, json_path: Path | None) -> None:
    print_report(report)
    if json_path is not None:
        write_json(report, json_path)


def _finish_on_origin(measure: Callable[[], Report], json_path: Path | None) -> None:
    """Run a bench that reads from an S3 origin and print its report; an origin that cannot
    be started is a bad ``--origin``."""
    from tierd_bench._origin import OriginUnavailable

    try:
        report = measure()
    except OriginUnavailable as exc:
        raise typer.BadParameter(str(exc), param_hint="--origin") from exc
    _finish(report, json_path)
