"""``tierd bench serving``'s command line (see :mod:`tierd_bench.serving`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tierd_bench import progress
from tierd_bench._cliopts import JsonOpt, _finish, _size

__all__ = ["bench_serving"]


def bench_serving(
    duration: Annotated[
        float, typer.Option("--duration", help="Seconds of each window.", min=0.5)
    ] = 5.0,
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats", "--repeat", help="Rounds of windows (idle, moves; idle, load).", min=1
        ),
    ] = 4,
    clients: Annotated[int, typer.Option("--clients", help="Concurrent clients.", min=1)] = 16,
    movers: Annotated[
        int, typer.Option("--movers", help="Files moving at once, each back and forth.", min=1)
    ] = 2,
    size: Annotated[str, typer.Option("--size", help="Size of each file moved.")] = "24MiB",
    cap: Annotated[
        float | None,
        typer.Option(
            "--cap", help="Bandwidth cap on moves, MiB/s (0: none; default: the policy's).", min=0
        ),
    ] = None,
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="Where the tiers go. Default: the temp dir.", file_okay=False),
    ] = None,
    runs: Annotated[
        int, typer.Option("--runs", help="Whole runs, each on a fresh server (medians).", min=1)
    ] = 1,
    origin: Annotated[
        str | None,
        typer.Option(
            "--origin",
            help="Also measure during large loads from this loopback S3 origin: open (nginx, "
            "no cap), s3like or moto.",
        ),
    ] = None,
    load_size: Annotated[
        str, typer.Option("--load-size", help="Size of the large load (with --origin).")
    ] = "256MiB",
    device: Annotated[
        str, typer.Option("--device", help="Where the large load goes: cpu or cuda:N.")
    ] = "cpu",
    json_path: JsonOpt = None,
) -> None:
    """Requests over REST at idle, while files move between tiers and (--origin) during large
    loads: p50/p99/p99.9, rate, ratios, the moves' slowdown."""
    from tierd_bench.serving import LOAD_ORIGINS, run

    if origin is not None and origin not in LOAD_ORIGINS:
        raise typer.BadParameter(f"one of {', '.join(LOAD_ORIGINS)}", param_hint="--origin")
    report = run(
        duration,
        repeats=repeats,
        runs=runs,
        clients=clients,
        movers=movers,
        move_size=_size(size),
        cap_mib_s="policy" if cap is None else (cap or None),
        origin=origin,
        load_size=_size(load_size),
        device=device,
        directory=directory,
        say=progress(),
    )
    _finish(report, json_path)
