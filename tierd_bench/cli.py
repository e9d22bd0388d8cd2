"""``tierd bench``: one command for every benchmark; the measuring is :mod:`tierd_bench`.

``tierd bench`` alone runs the data-path bench (``tierd bench data``), as it always has;
``tierd bench access|mover|rest|serving|models|codec|object-store|catalog|fleet`` run the others
(``--access`` and ``--object-store`` are the same as their sub-commands). Each prints the same
table to standard output (progress goes to standard error) and, with ``--json``, writes the
same JSON document.
Sub-benchmarks are imported when run, so ``tierd --help`` never loads the data path.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer

from tierd_bench import progress
from tierd_bench._cliengine import bench_engine
from tierd_bench._clifleet import bench_fleet
from tierd_bench._cliopts import (
    ColdOpt,
    ConnectionsOpt,
    DeviceOpt,
    DirOpt,
    JsonOpt,
    ObjectsOpt,
    OriginOpt,
    RateOpt,
    RepeatsOpt,
    RowsOpt,
    SamplesOpt,
    ShardsOpt,
    SizeOpt,
    SweepOpt,
    _finish,
    _finish_on_origin,
    _rate,
    _size,
)
from tierd_bench._cliserving import bench_serving
from tierd_bench._clitracker import bench_tracker

__all__ = ["bench_cli"]

bench_cli = typer.Typer(add_completion=False)

_OBJECT_STORE_ONLY = ("origin", "rate", "objects", "connections", "samples")
# The mover's default source: the system temp directory, usually a disk beside /dev/shm.
_TMP = Path(tempfile.gettempdir())


def _from_command_line(ctx: typer.Context, names: tuple[str, ...] | None = None) -> list[str]:
    """The options of ``ctx``'s command given on the command line (all, or among ``names``)."""
    return [
        param.opts[0]
        for param in ctx.command.params
        # By name: typer vendors its own click, whose enum is not click's.
        if param.name
        and (names is None or param.name in names)
        and getattr(ctx.get_parameter_source(param.name), "name", None) == "COMMANDLINE"
    ]


@bench_cli.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    size: SizeOpt = "1GiB",
    device: DeviceOpt = "auto",
    directory: DirOpt = None,
    rows: RowsOpt = 20_000,
    shards: ShardsOpt = 4,
    repeats: RepeatsOpt = 3,
    cold: ColdOpt = True,
    sweep: SweepOpt = False,
    access: Annotated[
        bool,
        typer.Option(
            "--access", help="Measure the access-ingest path instead (tierd bench access)."
        ),
    ] = False,
    object_store: Annotated[
        bool,
        typer.Option(
            "--object-store",
            help="Measure the object-store tier instead (tierd bench object-store).",
        ),
    ] = False,
    origin: OriginOpt = "moto",
    rate: RateOpt = "100MB",
    objects: ObjectsOpt = 10_000,
    connections: ConnectionsOpt = None,
    samples: SamplesOpt = 200,
    json_path: JsonOpt = None,
) -> None:
    """Measure this host's ceilings, the usual baselines and tierd's paths, in one run.

    Without a sub-command, the data-path bench (the same as tierd bench data).
    """
    if ctx.invoked_subcommand is not None:
        # `tierd bench --size 4GiB rest` would silently measure the default size: refuse.
        given = _from_command_line(ctx)
        if given:
            raise typer.BadParameter(
                f"{', '.join(given)} must come after the sub-command, as its own options "
                f"(tierd bench {ctx.invoked_subcommand} --help)"
            )
        return
    if object_store:
        bench_object_store(
            size, device, directory, repeats, origin, rate, objects, connections, samples, json_path
        )
        return
    stray = _from_command_line(ctx, _OBJECT_STORE_ONLY)
    if stray:
        raise typer.BadParameter(f"{', '.join(stray)}: only for --object-store")
    if access:
        bench_access(json_path=json_path)
        return
    bench_data(size, device, directory, rows, shards, repeats, cold, sweep, json_path)


@bench_cli.command("data")
def bench_data(
    size: SizeOpt = "1GiB",
    device: DeviceOpt = "auto",
    directory: DirOpt = None,
    rows: RowsOpt = 20_000,
    shards: ShardsOpt = 4,
    repeats: RepeatsOpt = 3,
    cold: ColdOpt = True,
    sweep: SweepOpt = False,
    json_path: JsonOpt = None,
) -> None:
    """Files into GPU (or host) memory: ceilings, baselines, peers and tierd, in one run."""
    from tierd_bench.data_path import run_bench

    report = run_bench(
        _size(size, minimum=1 << 20),
        device,
        directory,
        rows=rows,
        shards=shards,
        repeats=repeats,
        cold=cold,
        sweep=sweep,
        say=progress(),
    )
    _finish(report, json_path)


@bench_cli.command("access")
def bench_access(
    files: Annotated[int, typer.Option("--files", help="Files in the catalog.", min=1)] = 10_000,
    accesses: Annotated[
        int, typer.Option("--accesses", help="Accesses counted per timed run.", min=2)
    ] = 1_000_000,
    reads: Annotated[
        int, typer.Option("--reads", help="4 KiB reads per latency sample.", min=1)
    ] = 2_000,
    repeats: RepeatsOpt = 3,
    json_path: JsonOpt = None,
) -> None:
    """Access ingest: accesses counted per second, and a read's latency meanwhile."""
    from tierd_bench.access import measure_access_ingest

    report = measure_access_ingest(files, accesses, reads, repeats, say=progress())
    _finish(report, json_path)


@bench_cli.command("mover")
def bench_mover(
    size: Annotated[str, typer.Option("--size", help="Size of the file moved.")] = "256MiB",
    src: Annotated[
        Path,
        typer.Option("--src", help="Directory on the first filesystem.", file_okay=False),
    ] = _TMP,
    dst: Annotated[
        Path,
        typer.Option("--dst", help="Directory on the second filesystem.", file_okay=False),
    ] = Path("/dev/shm"),
    repeats: RepeatsOpt = 3,
    cap: Annotated[
        float,
        typer.Option("--cap", help="Bandwidth cap of one more move, MiB/s (0: none).", min=0),
    ] = 100.0,
    json_path: JsonOpt = None,
) -> None:
    """Migrations: tierd's copy path and whole move against cp + sync (+ rm), both ways."""
    from tierd_bench.mover import run

    nbytes = _size(size)
    for name, path in (("--src", src), ("--dst", dst)):
        if not path.is_dir():
            raise typer.BadParameter(f"{path} is not a directory", param_hint=name)
    report = run(nbytes, src, dst, repeats, cap or None, say=progress())
    _finish(report, json_path)


@bench_cli.command("rest")
def bench_rest(
    size: Annotated[str, typer.Option("--size", help="Size of the file loaded.")] = "1GiB",
    device: DeviceOpt = "auto",
    repeats: Annotated[
        int,
        typer.Option("--repeats", "--repeat", help="Timed whole-file loads (median).", min=1),
    ] = 5,
    small: Annotated[
        int, typer.Option("--small", help="Timed 4 KiB loads (p50, p99).", min=1)
    ] = 500,
    json_path: JsonOpt = None,
) -> None:
    """Loads over REST from a client process against tiering.io in-process."""
    from tierd_bench.rest import run

    report = run(_size(size, minimum=4096), device, repeats=repeats, small=small, say=progress())
    _finish(report, json_path)


@bench_cli.command("models")
def bench_models(
    size: Annotated[str, typer.Option("--size", help="Size of the model's weights.")] = "4GiB",
    device: DeviceOpt = "auto",
    shards: Annotated[int, typer.Option("--shards", help="Shards of the model.", min=1)] = 4,
    repeats: Annotated[
        int, typer.Option("--repeats", "--repeat", help="Timed loads (median).", min=1)
    ] = 5,
    json_path: JsonOpt = None,
) -> None:
    """A model over REST (one request, a shard at a time, as a state dict with its phase
    profile, from the memory tier) against in-process loads and fastsafetensors (two GPUs:
    TP=2 and replicas, one process per rank)."""
    from tierd_bench.models import run

    nbytes = _size(size, minimum=shards << 20)
    report = run(nbytes, device, shards=shards, repeats=repeats, say=progress())
    _finish(report, json_path)


@bench_cli.command("codec")
def bench_codec(
    size: Annotated[str, typer.Option("--size", help="Size of the bf16 checkpoint.")] = "256MiB",
    repeats: RepeatsOpt = 3,
    threads: Annotated[
        int | None, typer.Option("--threads", help="Threads of the all-cores figures.", min=1)
    ] = None,
    device: DeviceOpt = "auto",
    origin: Annotated[
        str | None,
        typer.Option(
            "--origin",
            help="Also load the checkpoint from a bucket, plain and compressed: moto, s3like "
            "(nginx, --rate per connection) or open (nginx, no cap), started on loopback.",
        ),
    ] = None,
    rate: RateOpt = "100MB",
    connections: ConnectionsOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """tierd's compressed format: ratio, CPU encode and decode GB/s against a raw read, on a
    GPU loads decoded there (nvCOMP) against plain ones, and with --origin the same from a
    bucket."""
    from tierd_bench.codec import run

    nbytes = _size(size, minimum=8 << 20)
    _finish_on_origin(
        lambda: run(
            nbytes,
            repeats=repeats,
            threads=threads,
            device=device,
            origin=origin,
            rate=_rate(rate),
            connections=connections,
            say=progress(),
        ),
        json_path,
    )


@bench_cli.command("memory")
def bench_memory(
    size: Annotated[str, typer.Option("--size", help="Size of the file.")] = "4GiB",
    device: DeviceOpt = "auto",
    repeats: Annotated[
        int, typer.Option("--repeats", "--repeat", help="Timed loads (median).", min=1)
    ] = 5,
    json_path: JsonOpt = None,
) -> None:
    """Loads from the memory tier and from GPU-resident copies against the page cache."""
    from tierd_bench.memory import run

    report = run(_size(size, minimum=1 << 20), device, repeats=repeats, say=progress())
    _finish(report, json_path)


@bench_cli.command("restart")
def bench_restart(
    size: Annotated[str, typer.Option("--size", help="Size of the file.")] = "4GiB",
    device: DeviceOpt = "auto",
    repeats: Annotated[
        int, typer.Option("--repeats", help="Client processes per row (median).", min=1)
    ] = 3,
    json_path: JsonOpt = None,
) -> None:
    """A serving process that restarts: its load of a GPU-resident copy against the first."""
    from tierd_bench.restart import run

    try:
        report = run(_size(size, minimum=1 << 20), device, repeats=repeats, say=progress())
    except RuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    _finish(report, json_path)


@bench_cli.command("multi-gpu")
def bench_multi_gpu(
    size: Annotated[str, typer.Option("--size", help="Size of the file and checkpoint.")] = "4GiB",
    repeats: Annotated[int, typer.Option("--repeats", help="Timed loads (median).", min=3)] = 3,
    json_path: JsonOpt = None,
) -> None:
    """One storage read filling 2 GPUs, and TP=2 slices to their GPUs (needs 2 GPUs)."""
    from tierd_bench.multigpu import run

    try:
        report = run(_size(size, minimum=64 << 20), repeats=repeats, say=progress())
    except RuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    _finish(report, json_path)


@bench_cli.command("object-store")
def bench_object_store(
    size: Annotated[str, typer.Option("--size", help="Size of the object moved.")] = "1GiB",
    device: DeviceOpt = "auto",
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="Where the nvme tier and the origin's files go (not tmpfs)."),
    ] = None,
    repeats: RepeatsOpt = 3,
    origin: OriginOpt = "moto",
    rate: RateOpt = "100MB",
    objects: ObjectsOpt = 10_000,
    connections: ConnectionsOpt = None,
    samples: SamplesOpt = 200,
    json_path: JsonOpt = None,
) -> None:
    """The object-store tier against S3 clients: promotion, demotion, loads into cuda and cpu
    (in process and over REST), 4 KiB reads, serving while it streams, adoption."""
    from tierd_bench.objectstore import run

    nbytes, cap = _size(size, minimum=1 << 20), _rate(rate)
    _finish_on_origin(
        lambda: run(
            nbytes,
            device,
            origin,
            repeats=repeats,
            rate=cap,
            objects=objects,
            connections=connections,
            samples=samples,
            directory=directory,
            say=progress(),
        ),
        json_path,
    )


@bench_cli.command("catalog")
def bench_catalog(
    seconds: Annotated[
        float, typer.Option("--seconds", help="Length of each timed run.", min=0.01)
    ] = 2.0,
    runs: Annotated[int, typer.Option("--runs", help="Timed runs per figure (median).", min=1)] = 3,
    hosts: Annotated[
        int,
        typer.Option("--hosts", help="Hosts writing at once on PostgreSQL (0: none).", min=0),
    ] = 3,
    catalog_url: Annotated[
        str | None,
        typer.Option(
            "--catalog-url",
            help="postgresql+psycopg://... of a server to measure, in a scratch database it "
            "creates and drops (needs CREATEDB). Default: a throwaway local PostgreSQL.",
        ),
    ] = None,
    json_path: JsonOpt = None,
) -> None:
    """Catalog writes per second: SQLite against PostgreSQL, and several hosts on PostgreSQL."""
    from tierd_bench._postgres import NoScratchDatabase
    from tierd_bench.catalog import CatalogBenchUnavailable, run

    try:
        report = run(seconds, runs, hosts, catalog_url, say=progress())
    except (CatalogBenchUnavailable, NoScratchDatabase) as exc:
        raise typer.BadParameter(str(exc), param_hint="--catalog-url") from exc
    _finish(report, json_path)


bench_cli.command("serving")(bench_serving)
bench_cli.command("tracker")(bench_tracker)
bench_cli.command("engine")(bench_engine)
bench_cli.command("fleet")(bench_fleet)
