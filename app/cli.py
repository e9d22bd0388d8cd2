"""The ``tierd`` command line."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from app.schemas import FileOut, TierOut
from app.settings import Settings, get_settings
from tiering.catalog import upgrade
from tiering.catalog.backends import redact
from tiering.engine import Engine
from tiering.errors import TierdError, Unavailable

__all__ = ["cli", "main"]

cli = typer.Typer(
    name="tierd",
    help="Keeps files on the right storage tier and gets them into GPU memory fast.",
    no_args_is_help=True,
    add_completion=False,
)
db_cli = typer.Typer(help="Catalog database.", no_args_is_help=True)
cli.add_typer(db_cli, name="db")

out = Console()
err = Console(stderr=True)

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML config file (or TIERD_CONFIG)")
]
DataDirOpt = Annotated[
    Path | None, typer.Option("--data-dir", help="Directory of the embedded default")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts")]


def _settings(config: Path | None, **overrides: Any) -> Settings:
    try:
        return get_settings(config, **overrides)
    except (ValidationError, FileNotFoundError, ValueError) as exc:
        err.print(f"[red]invalid configuration:[/red] {exc}")
        raise typer.Exit(2) from None


@contextmanager
def _engine(settings: Settings) -> Iterator[Engine]:
    engine = Engine(settings.engine_config())
    try:
        yield engine.open()
    except TierdError as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(1) from None
    finally:
        engine.stop()


@contextmanager
def exclusive_engine(settings: Settings, rest_hint: str) -> Iterator[Engine]:
    """The engine with its lock held and recovery done (like ``tierd serve``), without scan,
    watcher or scheduler. While a server holds the catalog, stop and point at ``rest_hint``:
    two processes writing one SQLite catalog is what RELIABILITY.md rules out."""
    cfg = dataclasses.replace(settings.engine_config(), scan_on_start=False, watch=False)
    engine = Engine(cfg)
    try:
        engine.start(scheduler=False)
    except Unavailable as exc:
        err.print(f"[red]error:[/red] {exc.message}; while it serves, use {rest_hint}")
        raise typer.Exit(1) from None
    try:
        yield engine
    except TierdError as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(1) from None
    finally:
        engine.stop()


def _print_json(obj: Any) -> None:
    out.print_json(json.dumps(obj, default=str))


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)


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

    settings = _settings(
        config, data_dir=data_dir, host=host, port=port, log_level=log_level, log_format=log_format
    )
    try:
        configure_logging(settings.log_level, settings.log_format)
    except ValueError as exc:
        err.print(f"[red]invalid configuration:[/red] {exc}")
        raise typer.Exit(2) from None
    _check_lock(settings)
    try:
        app = create_app(settings)
    except UnsafeBind as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    _check_tiers(settings)
    # log_config=None: uvicorn keeps the handlers configure_logging installed (text or JSON).
    uvicorn.run(
        app, host=settings.host, port=settings.port, log_level=settings.log_level, log_config=None
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
        err.print(f"[red]cannot start:[/red] {exc.message}", soft_wrap=True)  # one line
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
        err.print(f"[red]invalid configuration:[/red] {exc}")
        raise typer.Exit(2) from None
    try:
        for tier in tiers:
            tier.check()
        if config.memory is not None:  # its quota against RLIMIT_MEMLOCK and the host's RAM
            MemoryTier(config.memory, floor_bytes=config.memory_floor_bytes).check()
    except TierdError as exc:
        err.print(f"[red]cannot start:[/red] {exc.message}")
        raise typer.Exit(1) from None
    finally:
        tiers.close()


@db_cli.command("upgrade")
def db_upgrade(config: ConfigOpt = None, data_dir: DataDirOpt = None) -> None:
    """Create or upgrade the catalog schema (Alembic)."""
    settings = _settings(config, data_dir=data_dir)
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
    settings = _settings(config, data_dir=data_dir)
    # --check only reads; a real scan writes, so it must hold the catalog like a server does.
    opened = _engine(settings) if check else exclusive_engine(settings, "POST /v1/scan")
    with opened as engine:
        t0 = time.perf_counter()
        with out.status("scanning tiers…", spinner="dots") if not as_json else _null():
            report = engine.scan(check=check)
        elapsed = time.perf_counter() - t0
    drifted = check and bool(report.drift or report.conflicts)
    if as_json:
        _print_json(report.as_dict() | {"seconds": round(elapsed, 3)})
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
        out.print(f"[yellow]conflict[/yellow]: {path} is in tiers {', '.join(names)}")
    if drifted:
        raise typer.Exit(1)


@contextmanager
def _null() -> Iterator[None]:
    yield


@cli.command()
def tiers(config: ConfigOpt = None, data_dir: DataDirOpt = None, as_json: JsonOpt = False) -> None:
    """Show tiers with capacity, use and file counts."""
    settings = _settings(config, data_dir=data_dir)
    with _engine(settings) as engine:
        from app.api.tiers import gds_host

        gds = gds_host()
        rows = [TierOut.of(t, gds_host=gds) for t in engine.tier_infos()]
    if as_json:
        _print_json([r.model_dump(mode="json") for r in rows])
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
            _size(r.file_bytes),
            _size(r.quota_bytes),
            _size(r.free_bytes) if r.free_bytes is not None else "unknown",
            _size(r.capacity_bytes) if r.capacity_bytes is not None else "unknown",
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
    settings = _settings(config, data_dir=data_dir)
    with _engine(settings) as engine:
        if tier is not None:
            engine.tiers.get(tier)
        recs = engine.catalog.page(tier=tier, prefix=prefix, limit=limit)
        files = [FileOut.of(r, engine.heat(r)) for r in recs]
    if as_json:
        _print_json([f.model_dump(mode="json") for f in files])
        return
    table = Table("id", "path", "tier", "size", "heat", "accesses", "state")
    for f in files:
        table.add_row(
            str(f.id), f.path, f.tier, _size(f.size), f"{f.heat:.2f}", str(f.access_count), f.state
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
    settings = _settings(config, data_dir=data_dir)
    with _engine(settings) as engine:
        rec = engine.lookup(path)
        f = FileOut.of(rec, engine.heat(rec))
    if as_json:
        _print_json(f.model_dump(mode="json"))
        return
    table = Table(show_header=False, box=None)
    for key, value in f.model_dump().items():
        table.add_row(f"[bold]{key}[/bold]", "-" if value is None else str(value))
    out.print(table)


from app.cli_models import register as _register_models  # noqa: E402
from app.cli_tiering import register as _register_tiering  # noqa: E402
from tierd_bench.cli import bench_cli as _bench_cli  # noqa: E402

_register_tiering(cli, sys.modules[__name__])
_register_models(cli, sys.modules[__name__])
cli.add_typer(_bench_cli, name="bench")


def main() -> None:
    try:
        cli()
    except TierdError as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        sys.exit(1)


if __name__ == "__main__":
    main()
