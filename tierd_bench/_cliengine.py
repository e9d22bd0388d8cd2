"""``tierd bench engine``'s command line (see :mod:`tierd_bench.engine`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tierd_bench import progress
from tierd_bench._cliopts import DeviceOpt, JsonOpt, RepeatsOpt, _finish, _size

__all__ = ["bench_engine"]


def bench_engine(
    size: Annotated[
        str | None,
        typer.Option(
            "--size",
            help="The model's bf16 weights, e.g. 2GiB (default: 8GB on a GPU, 4MiB on cpu).",
        ),
    ] = None,
    device: DeviceOpt = "auto",
    repeats: RepeatsOpt = 3,
    directory: Annotated[
        Path | None,
        typer.Option(
            "--dir",
            help="Where the model is written once and kept (default: the "
            "temp dir's tierd-bench-engine); the server's tier links to it.",
        ),
    ] = None,
    rows: Annotated[
        str | None,
        typer.Option(
            "--rows",
            help="Rows to run, comma-separated, among from_pretrained, "
            "fastsafetensors, tierd, restart, peer, replicas (default: all).",
        ),
    ] = None,
    check: Annotated[
        bool, typer.Option("--check/--no-check", help="Compare every tensor with the files.")
    ] = True,
    catalog_url: Annotated[
        str | None,
        typer.Option(
            "--catalog-url",
            help="postgresql+psycopg://... for the peer row's two "
            "hosts, in a scratch database (default: a throwaway local PostgreSQL).",
        ),
    ] = None,
    json_path: JsonOpt = None,
) -> None:
    """An inference engine's cold start: fresh processes loading a transformers Llama model by
    from_pretrained, fastsafetensors and tierd, each phase to the first token."""
    from tierd_bench.engine import ROWS, run

    chosen = ROWS if rows is None else tuple(r.strip() for r in rows.split(",") if r.strip())
    if not chosen or set(chosen) - set(ROWS):
        raise typer.BadParameter(f"a list among {', '.join(ROWS)}", param_hint="--rows")
    nbytes = None if size is None else _size(size, minimum=1 << 20)
    report = run(
        nbytes,
        device,
        repeats=repeats,
        directory=directory,
        rows=chosen,
        check=check,
        catalog_url=catalog_url,
        say=progress(),
    )
    _finish(report, json_path)
