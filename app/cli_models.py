"""``tierd models [PREFIX]``: the models in the catalog (directories that directly hold
safetensors weights), with their size and the tiers and heat of their weights. Registered on
the CLI by ``app.cli``; like ``tierd ls``, it reads the catalog and changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from app.schemas_models import ModelOut
from tiering.serving.models import model_info, model_names, summarize

__all__ = ["register"]

# The helpers and options come from the module that registers us (app.cli), which keeps this
# module free of an import cycle with it.
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML config file (or TIERD_CONFIG)")
]
DataDirOpt = Annotated[
    Path | None, typer.Option("--data-dir", help="Directory of the embedded default")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts")]
_base: Any = None


def models(
    prefix: Annotated[str | None, typer.Argument(help="Model name prefix")] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List models: Hugging Face model directories, each placed and loaded as one unit."""
    settings = _base._settings(config, data_dir=data_dir)
    with _base._engine(settings) as engine:
        found = [
            ModelOut.of(summarize(engine, model_info(engine, name)))
            for name in model_names(engine, prefix)
        ]
    if as_json:
        _base._print_json([m.model_dump(mode="json") for m in found])
        return
    table = Table("model", "files", "size", "weights", "tiers of the weights", "heat", "pinned")
    for m in found:
        tiers = ", ".join(f"{t} {_base._size(n)}" for t, n in m.tiers.items())
        table.add_row(
            m.name + ("" if m.has_index else " (no index)"),
            str(m.file_count),
            _base._size(m.total_bytes),
            f"{m.weight_files} · {_base._size(m.weight_bytes)}",
            tiers,
            f"{m.heat_max:.2f}",
            m.pinned_tier or ("some files" if m.pinned_files else "-"),
        )
    _base.out.print(table)


def register(cli: typer.Typer, base: Any) -> None:
    """Add the command to ``cli``; ``base`` is the module with the shared helpers."""
    global _base
    _base = base
    cli.command()(models)
