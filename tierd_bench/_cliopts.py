"""Options and parsing that several ``tierd bench`` sub-commands share (:mod:`.cli`,
:mod:`._clifleet`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ._measure import format_size, parse_size
from ._report import Report, print_report, write_json

__all__ = ["JsonOpt", "RateOpt", "_finish", "_rate", "_size"]

JsonOpt = Annotated[
    Path | None,
    typer.Option("--json", "--out", help="Also write the results as JSON to this file."),
]
RateOpt = Annotated[
    str, typer.Option("--rate", help="Per-connection cap of the s3like origin, bytes/s (100MB).")
]


def _size(text: str, minimum: int = 1) -> int:
    try:
        nbytes = parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--size") from exc
    if nbytes < minimum:
        raise typer.BadParameter(f"must be at least {format_size(minimum)}", param_hint="--size")
    return nbytes


def _rate(text: str) -> int | None:
    try:
        rate = parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--rate") from exc
    return rate or None


def _finish(report: Report, json_path: Path | None) -> None:
    print_report(report)
    if json_path is not None:
        write_json(report, json_path)
