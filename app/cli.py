"""The ``tierd`` command line."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from app.cli_base import (
    ConfigOpt,
    DataDirOpt,
    JsonOpt,
    exclusive_engine,
    fail,
    human_size,
    load_settings,
    open_engine,
    out,
    print_config_error,
    print_json,
)
from app.cli_models import register as register_models
from app.cli_tiering import register as register_tiering
from app.schemas import FileOut, TierOut
from app.settings import Settings
from tiering.catalog import upgrade
from tiering.catalog.backends import redact
from tiering.errors import TierdError

#: Seconds an idle client connection stays open (see ``serve``).
KEEP_ALIVE_S = 65

__all__ = ["cli", "main"]


class _Commands(TyperGroup):
    """tierd's top-level commands, with ``tierd bench`` loaded only when it is asked for.

    The bench is a package of its own (its harness and peers are a fifth of the code): ``serve``
    and the catalog commands must not need it, and an image or wheel without it still starts.
    (Typer's click is its own vendored copy with no public types: hence the ``Any``.)
    """

    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), "bench"]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name != "bench":
            return super().get_command(ctx, cmd_name)
        try:
            from tierd_bench.cli import bench_cli
        except ImportError as exc:
            bench_cli = _missing_bench(exc)
        command = typer.main.get_command(bench_cli)
        command.name = "bench"
        return command


def _missing_bench(exc: ImportError) -> typer.Typer:
    why = f"tierd bench needs the tierd_bench package, which is not installed here ({exc})"
    stub = typer.Typer(add_completion=False)

    # One command (Typer makes a one-command app that command) that takes whatever follows.
    @stub.command(
        help=f"Benchmarks: not available ({why}).",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )
    def bench() -> None:
        fail(why)
        raise typer.Exit(2)

    return stub


cli = typer.Typer(
    cls=_Commands,
    name="tierd",
    help="Keeps files on the right storage tier and gets them into GPU memory fast.",
    no_args_is_help=True,
    add_completion=False,
)
db_cli = typer.Typer(help="Catalog database.", no_args_is_help=True)
cli.add_typer(db_cli, name="db")


@cli.command()
def serve(
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    host: Annotated[str | None, typer.Option(help="Address to listen on")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning, error")] = None,
    log_format: Annotated[
        str | None, typer.Option(help="text, or json: one JSON object per line")
    ] = None,
) -> None:
    """Run the service (upgrades the catalog and scans the tiers first)."""
    import uvicorn

    from app.logs import configure_logging
    from app.main import UnsafeBind, create_app

    settings = load_settings(
        config, data_dir=data_dir, host=host, port=port, log_level=log_level, log_format=log_format
    )
    try:
        configure_logging(settings.log_level, settings.log_format)
    except ValueError as exc:
        print_config_error(exc)
        raise typer.Exit(2) from None
    _check_lock(settings)
    try:
        app = create_app(settings)
    except UnsafeBind as exc:
        fail(str(exc), "cannot start")
        raise typer.Exit(2) from None
    _check_tiers(settings)
    # log_config=None: uvicorn keeps the handlers configure_logging installed (text or JSON).
    # Idle connections live KEEP_ALIVE_S (uvicorn's default is 5 s): a client opens its
    # connection when it is created, and an engine builds its model before its first load.
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


def _check_lock(settings: Settings) -> None:
    """Refuse to start, with one line naming it, while another tierd serves this catalog; the
    server's start would fail the same way in its lifespan, buried in a traceback."""
    from tiering.catalog.lock import CatalogLock

    config = settings.engine_config()
    lock = CatalogLock(config.catalog_url, host_id=config.host_id)
    try:
        lock.acquire()
    except TierdError as exc:
        fail(exc.message, "cannot start")  # one line
        raise typer.Exit(1) from None
    lock.release()  # the engine takes it again in the lifespan


def _check_tiers(settings: Settings) -> None:
    """Refuse to start, with one clear line, when a tier cannot be used (a bucket that is not
    there, refuses the credentials, denies a write or cannot be reached); the server's start
    would fail the same way, buried in a traceback."""
    from tiering.tiers import MemoryTier, Tiers

    try:
        config = settings.engine_config()
        tiers = Tiers(config.tiers)
    except ValueError as exc:
        print_config_error(exc)
        raise typer.Exit(2) from None
    try:
        for tier in tiers:
            tier.check()
        if config.memory is not None:  # its quota against RLIMIT_MEMLOCK and the host's RAM
            MemoryTier(config.memory, floor_bytes=config.memory_floor_bytes).check()
    except TierdError as exc:
        fail(exc.message, "cannot start")
        raise typer.Exit(1) from None
    finally:
        tiers.close()


@db_cli.command("upgrade")
def db_upgrade(config: ConfigOpt = None, data_dir: DataDirOpt = None) -> None:
    """Create or upgrade the catalog schema (Alembic)."""
    settings = load_settings(config, data_dir=data_dir)
    from app.logs import quiet_alembic

    quiet_alembic()
    upgrade(settings.catalog_url)
    out.print(f"catalog at {redact(settings.catalog_url)} is up to date")  # no password


@cli.command()
def scan(
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    check: Annotated[bool, typer.Option("--check", help="Report drift, change nothing")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Reconcile the catalog with the files in the tier roots (--check: exit 1 on drift)."""
    settings = load_settings(config, data_dir=data_dir)
    # --check only reads; a real scan writes, so it must hold the catalog like a server does.
    opened = open_engine(settings) if check else exclusive_engine(settings, "POST /v1/scan")
    with opened as engine:
        t0 = time.perf_counter()
        with out.status("scanning tiers…", spinner="dots") if not as_json else _null():
            report = engine.scan(check=check)
        elapsed = time.perf_counter() - t0
    drifted = check and bool(report.drift or report.conflicts)
    if as_json:
        print_json(report.as_dict() | {"seconds": round(elapsed, 3)})
        raise typer.Exit(1 if drifted else 0)
    verb = "would be" if check else "were"
    out.print(f"scanned in {elapsed:.2f}s: {report.unchanged} unchanged")
    for label, items in (
        ("adopted", report.adopted),
        ("changed", report.changed),
        ("moved between tiers", report.moved),
        ("marked missing", report.missing),
    ):
        if items:
            out.print(
                f"{len(items)} {verb} {label}: "
                + ", ".join(items[:10])
                + (" …" if len(items) > 10 else "")
            )
    for path, names in report.conflicts.items():
        line = f": {path} is in tiers {', '.join(names)}"
        out.print(Text("conflict", style="yellow") + Text(line), soft_wrap=True)
    if drifted:
        raise typer.Exit(1)


@contextmanager
def _null() -> Iterator[None]:
    yield


@cli.command()
def tiers(config: ConfigOpt = None, data_dir: DataDirOpt = None, as_json: JsonOpt = False) -> None:
    """Show tiers with capacity, use and file counts."""
    settings = load_settings(config, data_dir=data_dir)
    with open_engine(settings) as engine:
        from app.api.tiers import gds_host

        gds = gds_host()
        rows = [TierOut.of(t, gds_host=gds) for t in engine.tier_infos()]
    if as_json:
        print_json([r.model_dump(mode="json") for r in rows])
        return
    table = Table(
        "rank", "tier", "kind", "path", "files", "file bytes", "quota", "free", "capacity", "GDS"
    )
    for r in rows:
        # An object store has no capacity and no free space of its own: shown as "unknown".
        table.add_row(
            str(r.rank),
            r.name,
            r.kind,
            r.path,
            str(r.files),
            human_size(r.file_bytes),
            human_size(r.quota_bytes),
            human_size(r.free_bytes) if r.free_bytes is not None else "unknown",
            human_size(r.capacity_bytes) if r.capacity_bytes is not None else "unknown",
            "yes" if r.gds else "no",
        )
    out.print(table)


@cli.command("ls")
def ls(
    prefix: Annotated[str | None, typer.Argument(help="Relpath prefix")] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    tier: Annotated[str | None, typer.Option(help="Only this tier")] = None,
    limit: Annotated[int, typer.Option(help="Most files to show")] = 1000,
    as_json: JsonOpt = False,
) -> None:
    """List files in the catalog."""
    settings = load_settings(config, data_dir=data_dir)
    with open_engine(settings) as engine:
        if tier is not None:
            engine.tiers.get(tier)
        recs = engine.catalog.page(tier=tier, prefix=prefix, limit=limit)
        files = [FileOut.of(r, engine.heat(r)) for r in recs]
    if as_json:
        print_json([f.model_dump(mode="json") for f in files])
        return
    table = Table("id", "path", "tier", "size", "heat", "accesses", "state")
    for f in files:
        table.add_row(
            str(f.id),
            f.path,
            f.tier,
            human_size(f.size),
            f"{f.heat:.2f}",
            str(f.access_count),
            f.state,
        )
    out.print(table)


@cli.command()
def stat(
    path: Annotated[str, typer.Argument(help="File relpath")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show one file's record."""
    settings = load_settings(config, data_dir=data_dir)
    with open_engine(settings) as engine:
        rec = engine.lookup(path)
        f = FileOut.of(rec, engine.heat(rec))
    if as_json:
        print_json(f.model_dump(mode="json"))
        return
    table = Table(show_header=False, box=None)
    for key, value in f.model_dump().items():
        table.add_row(Text(key, style="bold"), "-" if value is None else str(value))
    out.print(table)


register_tiering(cli)
register_models(cli)


def main() -> None:
    try:
        cli()
    except TierdError as exc:
        fail(exc.message)
        sys.exit(1)


if __name__ == "__main__":
    main()
