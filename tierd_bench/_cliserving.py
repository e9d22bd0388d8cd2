"""``tierd bench serving``'s command line (see :mod:`tierd_bench.serving`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tierd_bench import progress
from tierd_bench._cliopts import JsonOpt, _finish_on_origin, _size
from tierd_bench._report import Report

__all__ = ["bench_serving"]

# -- the large load's options (see tierd_bench._serving_load) --------------------------------------
_OriginOpt = Annotated[
    str | None,
    typer.Option(
        "--origin",
        help="Also measure during large loads from this loopback S3 origin: open (nginx, "
        "no cap), s3like or moto.",
    ),
]
_LoadSizeOpt = Annotated[
    str, typer.Option("--load-size", help="Size of the large load (with --origin).")
]
_DeviceOpt = Annotated[
    str, typer.Option("--device", help="Where the large load goes: cpu or cuda:N.")
]
# -- the phases, and the peer fills' options (see tierd_bench._serving_fills) ----------------------
_PhasesOpt = Annotated[
    str,
    typer.Option(
        "--phases",
        help="Busy phases beside idle, comma-separated: moves (files moving between tiers), "
        "fills (copies filling from a peer's pieces: a second tierd, PostgreSQL and moto; "
        "skipped, saying why, where they are missing), load (needs --origin, which adds it).",
    ),
]
_FillersOpt = Annotated[
    int, typer.Option("--fillers", help="Files filling from the peer at once (fills).", min=1)
]
_FillSizeOpt = Annotated[
    str, typer.Option("--fill-size", help="Size of each file filled from the peer.")
]
_CatalogOpt = Annotated[
    str | None,
    typer.Option(
        "--catalog-url",
        help="The fills' catalog: postgresql+psycopg://... of a server, in a scratch database "
        "the bench creates and drops (needs CREATEDB). Default: a throwaway local PostgreSQL.",
    ),
]


def bench_serving(
    duration: Annotated[
        float, typer.Option("--duration", help="Seconds of each window.", min=0.5)
    ] = 10.0,  # serving.DURATION_S, REPEATS, RUNS: that module is imported only to run
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats", "--repeat", help="Rounds of windows (idle, then each phase).", min=1
        ),
    ] = 6,
    phases: _PhasesOpt = "moves",
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
    ] = 3,
    origin: _OriginOpt = None,
    load_size: _LoadSizeOpt = "256MiB",
    device: _DeviceOpt = "cpu",
    fillers: _FillersOpt = 1,
    fill_size: _FillSizeOpt = "64MiB",
    catalog_url: _CatalogOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Requests over REST at idle, while files move between tiers, while copies fill from a
    peer (--phases fills) and (--origin) during large loads: p50/p99/p99.9, rate, ratios, the
    moves' and the fills' slowdown."""
    from tierd_bench.serving import LOAD_ORIGINS, busy_phases, run

    if origin is not None and origin not in LOAD_ORIGINS:
        raise typer.BadParameter(f"one of {', '.join(LOAD_ORIGINS)}", param_hint="--origin")
    chosen = [p.strip() for p in phases.split(",") if p.strip()]
    try:
        busy_phases(chosen, origin)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--phases") from exc
    from tierd_bench._postgres import NoScratchDatabase, require_postgresql

    require_postgresql(catalog_url, typer.BadParameter)  # a bad URL is a usage error, not a skip

    def measure() -> Report:
        try:
            return run(
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
                phases=chosen,
                fillers=fillers,
                fill_size=_size(fill_size),
                catalog_url=catalog_url,
                directory=directory,
                say=progress(),
            )
        except NoScratchDatabase as exc:
            raise typer.BadParameter(str(exc), param_hint="--catalog-url") from exc

    _finish_on_origin(measure, json_path)
