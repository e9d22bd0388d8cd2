"""``tierd models [PREFIX]``: the models in the catalog (directories that directly hold
safetensors weights), with their size and the tiers and heat of their weights. Registered on
the CLI by ``app.cli``; like ``tierd ls``, it reads the catalog and changes nothing."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from app.cli_base import (
    ConfigOpt,
    DataDirOpt,
    JsonOpt,
    human_size,
    load_settings,
    open_engine,
    out,
    print_json,
)
from app.schemas_models import ModelOut
from tiering.serving.models import model_info, model_names, summarize

__all__ = ["register"]


def models(
    prefix: Annotated[str | None, typer.Argument(help="Model name prefix")] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List models: Hugging Face model directories, each placed and loaded as one unit."""
    settings = load_settings(config, data_dir=data_dir)
    with open_engine(settings) as engine:
        found = [
            ModelOut.of(summarize(engine, model_info(engine, name)))
            for name in model_names(engine, prefix)
        ]
    if as_json:
        print_json([m.model_dump(mode="json") for m in found])
        return
    table = Table("model", "files", "size", "weights", "tiers of the weights", "heat", "pinned")
    for m in found:
        tiers = ", ".join(f"{t} {human_size(n)}" for t, n in m.tiers.items())
        table.add_row(
            m.name + ("" if m.has_index else " (no index)"),
            str(m.file_count),
            human_size(m.total_bytes),
            f"{m.weight_files} · {human_size(m.weight_bytes)}",
            tiers,
            f"{m.heat_max:.2f}",
            m.pinned_tier or ("some files" if m.pinned_files else "-"),
        )
    out.print(table)


def register(cli: typer.Typer) -> None:
    """Add the command to ``cli``."""
    cli.command()(models)
