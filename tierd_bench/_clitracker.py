"""``tierd bench tracker``'s command line (see :mod:`tierd_bench.tracker`)."""

from __future__ import annotations

from typing import Annotated

import typer

from tierd_bench import progress
from tierd_bench._cliopts import JsonOpt, _finish, _size

__all__ = ["bench_tracker"]


def bench_tracker(
    hosts: Annotated[
        str, typer.Option("--hosts", help="Fleet sizes to simulate, comma-separated.")
    ] = "10,100",
    size: Annotated[str, typer.Option("--size", help="The model's size, e.g. 16GiB.")] = "16GiB",
    seconds: Annotated[
        float, typer.Option("--seconds", help="How long each fleet fills.", min=0.1)
    ] = 5.0,
    workers: Annotated[
        int | None, typer.Option("--workers", help="Client processes (default: the cores).")
    ] = None,
    polls: Annotated[
        float | None,
        typer.Option(
            "--tracker-polls",
            help="The fleet's polls a second held to (default: the fleet_tracker_polls setting's).",
            min=1,
        ),
    ] = None,
    catalog_url: Annotated[
        str | None,
        typer.Option(
            "--catalog-url",
            help="postgresql+psycopg://... of a server to measure, in a scratch database "
            "(needs CREATEDB). Default: a throwaway local PostgreSQL.",
        ),
    ] = None,
    json_path: JsonOpt = None,
) -> None:
    """The fleet's tracker (its PostgreSQL catalog) under N hosts filling one model at once:
    piece events/s and polls/s, a poll's latency, the clients' lag, PostgreSQL's CPU and WAL,
    and the rollout time the tracker alone allows."""
    from tierd_bench._postgres import NoScratchDatabase
    from tierd_bench.tracker import TrackerBenchUnavailable, run

    try:
        sizes = [int(h) for h in hosts.split(",") if h.strip()]
        if not sizes or min(sizes) < 1:
            raise ValueError(hosts)
    except ValueError:
        msg = "a list of host counts, e.g. 10,100"
        raise typer.BadParameter(msg, param_hint="--hosts") from None
    try:
        report = run(
            sizes,
            _size(size, minimum=1 << 20),
            seconds=seconds,
            workers=workers,
            polls_per_s=polls,
            catalog_url=catalog_url,
            say=progress(),
        )
    except (TrackerBenchUnavailable, NoScratchDatabase) as exc:
        raise typer.BadParameter(str(exc), param_hint="--catalog-url") from exc
    _finish(report, json_path)
