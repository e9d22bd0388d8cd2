"""What every ``tierd`` command module shares: the consoles, the common options, and opening the
configuration and the engine.

``app.cli`` and the command modules it mounts (``app.cli_tiering``, ``app.cli_models``) import
this module; it imports none of them, so the commands hold no import cycle (before, ``app.cli``
handed its own module object to the others, whose calls back into it the import graph could not
see).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.text import Text

from app.settings import Settings, get_settings
from tiering.catalog.backends import sqlite_file
from tiering.engine import Engine
from tiering.errors import TierdError, Unavailable

__all__ = [
    "ConfigOpt",
    "DataDirOpt",
    "JsonOpt",
    "config_error",
    "err",
    "fail",
    "exclusive_engine",
    "human_size",
    "load_settings",
    "open_engine",
    "out",
    "print_config_error",
    "print_json",
]

# No markup: what tierd prints (paths, messages, patterns like ``^[a-z]{0,63}$``) is shown as
# written; a bracket in a file name was read as a style, and ``[/x]`` raised MarkupError.
out = Console(markup=False)
err = Console(stderr=True, markup=False)

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML config file (or TIERD_CONFIG)")
]
DataDirOpt = Annotated[
    Path | None, typer.Option("--data-dir", help="Directory of the embedded default")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts")]


def config_error(exc: BaseException) -> str:
    """A configuration error as one plain line: each of pydantic's errors as
    ``where: what`` (``tiers.1.path: ...``), joined by ``; ``, without its input echo and
    documentation link."""
    if isinstance(exc, ValidationError):
        parts = []
        for e in exc.errors(include_url=False, include_input=False):
            where = ".".join(str(x) for x in e["loc"])
            what = str(e["msg"]).removeprefix("Value error, ")
            parts.append(f"{where}: {what}" if where else what)
        return "; ".join(parts)
    return " ".join(str(exc).split())


def fail(message: str, label: str = "error") -> None:
    """``<label>: <message>`` on stderr, the label in red, one line at any width, the message
    as written (never read as markup)."""
    err.print(Text(f"{label}: ", style="red") + Text(message), soft_wrap=True, highlight=False)


def print_config_error(exc: BaseException) -> None:
    """``invalid configuration: <the error>`` on stderr, one line, never read as markup (a
    pattern like ``^{0,63}$`` or ``[a-z]`` is printed as written)."""
    fail(config_error(exc), "invalid configuration")


def load_settings(config: Path | None, **overrides: Any) -> Settings:
    """The settings, or exit 2 with the configuration's error."""
    try:
        return get_settings(config, **overrides)
    except tomllib.TOMLDecodeError as exc:  # which file, and where in it tomllib says
        print_config_error(ValueError(f"{config or os.environ.get('TIERD_CONFIG')}: {exc}"))
        raise typer.Exit(2) from None
    except (ValidationError, FileNotFoundError, ValueError) as exc:
        print_config_error(exc)
        raise typer.Exit(2) from None


def _require_catalog(settings: Settings) -> None:
    """Exit 2 where the SQLite catalog does not exist (a mistyped ``--data-dir``): a command
    that needs cataloged files makes nothing, where it created an empty data dir, catalog and
    tiers and exited 0 with nothing to show."""
    catalog = sqlite_file(settings.catalog_url)
    if catalog is not None and not catalog.exists():
        fail(
            f"no catalog at {catalog}: no files to work on (is --data-dir right? "
            "`tierd serve` or `tierd db upgrade` creates it)"
        )
        raise typer.Exit(2)


@contextmanager
def open_engine(settings: Settings) -> Iterator[Engine]:
    """The engine opened for reading; a tierd error exits 1 with its message. A command that
    only reads makes nothing: where the SQLite catalog does not exist (a mistyped
    ``--data-dir``), it exits 2 saying so instead of creating an empty one and its tiers."""
    _require_catalog(settings)
    engine = Engine(settings.engine_config())
    try:
        yield engine.open()
    except TierdError as exc:
        fail(exc.message)
        raise typer.Exit(1) from None
    finally:
        engine.stop()


@contextmanager
def exclusive_engine(
    settings: Settings, rest_hint: str, *, needs_catalog: bool = False
) -> Iterator[Engine]:
    """The engine with its lock held and recovery done (like ``tierd serve``), without scan,
    watcher or scheduler. While a server holds the catalog, stop and point at ``rest_hint``:
    two processes writing one SQLite catalog is what RELIABILITY.md rules out. A command that
    acts on cataloged files (``needs_catalog``: pin, unpin, migrate) makes no catalog either;
    scan (it adopts what the roots hold) and policy set may start one."""
    if needs_catalog:
        _require_catalog(settings)
    cfg = dataclasses.replace(settings.engine_config(), scan_on_start=False, watch=False)
    engine = Engine(cfg)
    try:
        engine.start(scheduler=False)
    except Unavailable as exc:
        fail(f"{exc.message}; while it serves, use {rest_hint}")
        raise typer.Exit(1) from None
    try:
        yield engine
    except TierdError as exc:
        fail(exc.message)
        raise typer.Exit(1) from None
    finally:
        engine.stop()


def print_json(obj: Any) -> None:
    """``obj`` as JSON on standard output, for scripts."""
    out.print_json(json.dumps(obj, default=str))


def human_size(n: int | None) -> str:
    """A byte count for people: ``1.5 GiB``; ``-`` for unknown."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)
