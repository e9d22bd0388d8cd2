"""``tierd bench fleet``: its options and their parsing (registered by :mod:`.cli`). The
measures are :mod:`.fleet` (a fleet job against prefetches by hand) and, with ``--network``,
:mod:`.fleetnet` (warm time and origin bytes per host count, in network namespaces); both are
imported when run, so that ``tierd --help`` loads neither."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ._cliopts import JsonOpt, RateOpt, _finish, _rate, _size
from ._report import progress

__all__ = ["bench_fleet"]


def _counts(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise typer.BadParameter(f"not host counts: {text!r} (e.g. 1,4,8)", param_hint="--counts")
    return counts


def _bits(text: str, hint: str) -> int:
    from .fleetnet import parse_bits

    try:
        return parse_bits(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=hint) from exc


# The options, declared once here so that the command's signature reads as its list.
_SizeOpt = Annotated[
    str | None,
    typer.Option("--size", help="Size of the model, all shards (256MiB; --network 128MiB)."),
]
_ShardsOpt = Annotated[int, typer.Option("--shards", help="Shards of the model.", min=1)]
_HostsOpt = Annotated[int, typer.Option("--hosts", help="tierd servers started.", min=1)]
_RunsOpt = Annotated[
    int | None,
    typer.Option("--runs", help="Timed runs per figure, median (3; --network 1).", min=1),
]
_OriginOpt = Annotated[
    str | None,
    typer.Option(
        "--origin",
        help="S3 origin: moto, s3like (nginx, --rate per connection), open (nginx, no cap) "
        "or http(s)://host[:port]/bucket; default moto (--network: open; nginx only).",
    ),
]
_NetworkOpt = Annotated[
    bool,
    typer.Option(
        "--network",
        help="Warm time and origin bytes for --counts hosts, the origin and each host in "
        "a network namespace with tc-shaped links (needs root; else on loopback).",
    ),
]
_CountsOpt = Annotated[
    str, typer.Option("--counts", help="--network: host counts measured, e.g. 1,4,8.")
]
_OriginRateOpt = Annotated[
    str, typer.Option("--origin-rate", help="--network: the origin's egress cap, bits/s.")
]
_HostRateOpt = Annotated[
    str, typer.Option("--host-rate", help="--network: each host's link rate, bits/s.")
]
_PollOpt = Annotated[
    float | None,
    typer.Option(
        "--poll-interval",
        help="The hosts' fleet_poll_interval_s (default: the setting's, 1 s).",
        min=0.001,
    ),
]
_CatalogOpt = Annotated[
    str | None,
    typer.Option(
        "--catalog-url",
        help="postgresql+psycopg://... of a server to run on, in a scratch database it "
        "creates and drops (needs CREATEDB). Default: a throwaway local PostgreSQL.",
    ),
]
_DirOpt = Annotated[
    Path | None,
    typer.Option("--dir", help="Where the hosts' data dirs go (not tmpfs). Default: here."),
]
_CompressedOpt = Annotated[
    bool,
    typer.Option(
        "--compressed",
        help="bf16 weights, in the bucket as tierd's object tier stores them: compressed.",
    ),
]


def bench_fleet(
    size: _SizeOpt = None,
    shards: _ShardsOpt = 4,
    hosts: _HostsOpt = 3,
    runs: _RunsOpt = None,
    origin: _OriginOpt = None,
    rate: RateOpt = "100MB",
    network: _NetworkOpt = False,
    counts: _CountsOpt = "1,4,8",
    origin_rate: _OriginRateOpt = "400Mbit",
    host_rate: _HostRateOpt = "2Gbit",
    poll_interval: _PollOpt = None,
    catalog_url: _CatalogOpt = None,
    directory: _DirOpt = None,
    compressed: _CompressedOpt = False,
    json_path: JsonOpt = None,
) -> None:
    """A model onto every host: one fleet prefetch against one prefetch per host by hand;
    with --network, warm time and origin bytes for 1, 4 and 8 hosts on shaped links."""
    from . import fleet, fleetnet

    nbytes = _size(size or ("128MiB" if network else "256MiB"), minimum=shards * 16 << 10)
    try:
        if network:
            report = fleetnet.run(
                nbytes,
                shards,
                _counts(counts),
                runs or 1,
                origin or "open",
                origin_bps=_bits(origin_rate, "--origin-rate"),
                host_bps=_bits(host_rate, "--host-rate"),
                rate=_rate(rate),
                poll_interval=poll_interval,
                catalog_url=catalog_url,
                directory=directory,
                compressed=compressed,
                say=progress(),
            )
        else:
            report = fleet.run(
                nbytes,
                shards,
                hosts,
                runs or 3,
                origin or "moto",
                rate=_rate(rate),
                poll_interval=poll_interval,
                catalog_url=catalog_url,
                directory=directory,
                compressed=compressed,
                say=progress(),
            )
    except fleet.FleetBenchUnavailable as exc:
        raise typer.BadParameter(str(exc)) from exc
    except fleet.FleetBenchFailed as exc:
        typer.echo(f"tierd bench fleet failed: {exc}", err=True)
        raise typer.Exit(1) from exc
    _finish(report, json_path)
