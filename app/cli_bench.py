"""``tierd bench``: registered by ``app.cli``; the measuring is :mod:`tiering.bench`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["bench"]


def bench(
    size: Annotated[
        str, typer.Option("--size", help="Test file size, e.g. 4GiB, 512MiB, 1G.")
    ] = "1GiB",
    device: Annotated[
        str, typer.Option("--device", help="cuda:N, cpu, or auto (a GPU when there is one).")
    ] = "auto",
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="Where to write test files (not tmpfs). Default: here."),
    ] = None,
    rows: Annotated[int, typer.Option("--rows", help="Rows per random gather.", min=1)] = 20_000,
    shards: Annotated[
        int, typer.Option("--shards", help="safetensors shards for the multi-shard load.", min=1)
    ] = 4,
    repeats: Annotated[
        int, typer.Option("--repeats", help="Timed runs per figure; the median is shown.", min=1)
    ] = 3,
    cold: Annotated[
        bool, typer.Option("--cold/--no-cold", help="Measure cold-cache figures too.")
    ] = True,
    sweep: Annotated[
        bool, typer.Option("--sweep", help="Also sweep threads x task size for hot loads.")
    ] = False,
    access: Annotated[
        bool,
        typer.Option(
            "--access", help="Measure the access-ingest path instead: accesses counted per second."
        ),
    ] = False,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the results as JSON to this file.")
    ] = None,
) -> None:
    """Measure this host's ceilings, the usual baselines and tierd's I/O paths, in one run."""
    from rich.console import Console

    from tiering.bench import parse_size, render, run_bench

    if access:
        _access_bench(json_path)
        return

    try:
        nbytes = parse_size(size)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--size") from exc
    err = Console(stderr=True)
    result = run_bench(
        nbytes,
        device,
        directory,
        rows=rows,
        shards=shards,
        repeats=repeats,
        cold=cold,
        sweep=sweep,
        say=lambda s: err.print(s, markup=False, highlight=False),
    )
    Console().print(render(result))
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2))


def _access_bench(json_path: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from tiering.bench.access import measure_access_ingest

    err = Console(stderr=True)
    with err.status("counting accesses into a 10,000-file catalog…"):
        result = measure_access_ingest()
    table = Table("measure", "value", title="access ingest (medians of 3)")
    for key, value in result.items():
        unit = " /s" if key.endswith("_per_s") or key.endswith("_2threads") else ""
        table.add_row(key, f"{value:,.0f}{unit}" if isinstance(value, float) else str(value))
    Console().print(table)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2))
