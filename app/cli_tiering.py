"""``tierd policy show|set``, ``tierd plan``, ``tierd migrate``, ``tierd migrations``,
``tierd pin|unpin``: registered on the CLI by ``app.cli``.

They work on the catalog directly. Commands that change something take the engine's exclusive
lock and run recovery first, exactly like ``tierd serve``; while a server holds the catalog they
stop with a pointer to the equivalent REST call instead of writing beside it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from app.cli_base import (
    ConfigOpt,
    DataDirOpt,
    JsonOpt,
    err,
    exclusive_engine,
    fail,
    human_size,
    load_settings,
    open_engine,
    out,
    print_json,
)
from app.schemas import DecisionOut, FileOut, MigrationOut, PlannedMoveOut, PolicyOut
from app.settings import Settings
from tiering.engine import MigrationInfo
from tiering.errors import TierdError

__all__ = ["register"]


policy_cli = typer.Typer(help="The tiering policy.", no_args_is_help=True)


def _exclusive(settings: Settings, rest_hint: str, *, needs_catalog: bool = True) -> Any:
    return exclusive_engine(settings, rest_hint, needs_catalog=needs_catalog)


def _policy_table(p: PolicyOut) -> None:
    doc = p.policy
    who = f" by {p.author}" if p.author else ""
    when = f" at {p.created_at:%Y-%m-%d %H:%M:%S}" if p.created_at else " (built-in default)"
    out.print(f"policy version {p.version}{who}{when}")
    table = Table("tier", "min heat", "quota", "high mark", "low mark")
    for name, t in doc["tiers"].items():
        table.add_row(
            name,
            f"{t['min_heat']:g}",
            human_size(t["quota_bytes"]),
            f"{t['high_watermark']:.0%}",
            f"{t['low_watermark']:.0%}",
        )
    out.print(table)
    for key in (
        "half_life_s",
        "hysteresis",
        "min_age_s",
        "interval_s",
        "concurrency",
        "bandwidth_bytes_per_s",
        "enabled",
        "promotion_heat",
    ):
        value = doc[key]
        shown = (
            f"{human_size(value)}/s"
            if key == "bandwidth_bytes_per_s" and value
            else "no cap"
            if key == "bandwidth_bytes_per_s"
            else str(value)
        )
        out.print(f"  {key}: {shown}")


@policy_cli.command("show")
def policy_show(
    config: ConfigOpt = None, data_dir: DataDirOpt = None, as_json: JsonOpt = False
) -> None:
    """Show the policy in force."""
    with open_engine(load_settings(config, data_dir=data_dir)) as engine:
        p = PolicyOut.of(engine.policy_info())
    if as_json:
        print_json(p.model_dump(mode="json"))
    else:
        _policy_table(p)


@policy_cli.command("set")
def policy_set(
    file: Annotated[str, typer.Argument(help="JSON policy document, or - for stdin")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Replace the policy with a JSON document (see `tierd policy show --json`)."""
    try:
        text = sys.stdin.read() if file == "-" else Path(file).read_text()
        document = json.loads(text)
    except (OSError, json.JSONDecodeError) as exc:
        fail(f"cannot read a JSON policy from {file}: {exc}")
        raise typer.Exit(2) from None
    if isinstance(document, dict) and isinstance(document.get("policy"), dict):
        document = document["policy"]  # accept `policy show --json` output as it is
    settings = load_settings(config, data_dir=data_dir)
    with _exclusive(settings, "PUT /v1/policy", needs_catalog=False) as engine:
        p = PolicyOut.of(engine.set_policy(document, author="cli"))
    if as_json:
        print_json(p.model_dump(mode="json"))
    else:
        _policy_table(p)


def _plan_rows(moves: list[PlannedMoveOut]) -> None:
    if not moves:
        out.print("nothing to move")
        return
    table = Table("id", "path", "move", "size", "reason")
    for m in moves:
        table.add_row(
            str(m.file_id), m.path, f"{m.from_tier} → {m.to_tier}", human_size(m.size), m.reason
        )
    out.print(table)


def plan(config: ConfigOpt = None, data_dir: DataDirOpt = None, as_json: JsonOpt = False) -> None:
    """Dry run: what the policy would move now, and why."""
    with open_engine(load_settings(config, data_dir=data_dir)) as engine:
        moves = [PlannedMoveOut.of(m) for m in engine.plan()]
    if as_json:
        print_json([m.model_dump(mode="json") for m in moves])
    else:
        _plan_rows(moves)


def explain(
    path: Annotated[str, typer.Argument(help="File relpath")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Why a file is on its tier: the move the policy makes now, or each reason it stays.
    (The scheduler is taken to run; its policy ``enabled`` switch still counts.)"""
    with open_engine(load_settings(config, data_dir=data_dir)) as engine:
        d = DecisionOut.of(engine.explain(engine.lookup(path).id, scheduler=True))
    if as_json:
        print_json(d.model_dump(mode="json"))
        return
    out.print(f"{d.path} (id {d.file_id}) on {d.tier}, heat {d.heat:g}")
    out.print(f"wants {d.wanted_tier}: {d.why}")
    if d.move is not None:
        out.print(f"moves: {d.move.reason}")
    elif d.tier == d.wanted_tier:
        out.print("stays: it is where it belongs")
    for r in d.reasons:
        out.print(f"  - {r.code}: {r.message}")


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}", markup=False),  # a relpath, as written
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    )


def migrate(
    path: Annotated[str | None, typer.Argument(help="File relpath; omit to run the plan")] = None,
    to: Annotated[
        str | None, typer.Option("--to", help="Destination tier of a manual move")
    ] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Move one file (PATH --to TIER), or run the policy's plan now, with a progress bar."""
    if (path is None) != (to is None):
        fail("a manual move needs both PATH and --to TIER")
        raise typer.Exit(2)
    settings = load_settings(config, data_dir=data_dir)
    results: list[MigrationInfo] = []
    failed = 0
    with _exclusive(settings, "POST /v1/migrations") as engine:
        if path is not None and to is not None:
            rec = engine.lookup(path)
            todo = [(rec.id, rec.relpath, to, rec.size, "manual")]
        else:
            todo = [(m.file_id, m.relpath, m.dst, m.size, m.reason) for m in engine.plan()]
        with _progress() if not as_json else _nullprogress() as bar:
            for file_id, relpath, dst, size, reason in todo:
                task = bar.add_task(f"{relpath} → {dst}", total=size) if bar else None

                def tick(done: int, total: int, task: Any = task) -> None:
                    if bar is not None:
                        bar.update(task, completed=done, total=total)

                try:
                    results.append(engine.migrate(file_id, dst, reason=reason, progress=tick))
                except TierdError as exc:
                    failed += 1
                    fail(exc.message, relpath)
                    if path is not None:
                        raise typer.Exit(1) from None
                finally:
                    if bar is not None and task is not None:
                        bar.remove_task(task)
        rows = [MigrationOut.of(engine.migration(r.record.id)) for r in results]
    if as_json:
        print_json([r.model_dump(mode="json") for r in rows])
    else:
        for r in rows:
            secs = r.duration_s or 0.0
            rate = f", {human_size(int(r.bytes_copied / secs))}/s" if secs > 0 else ""
            out.print(
                f"{r.path}: {r.from_tier} → {r.to_tier} {r.state} "
                f"({human_size(r.bytes_copied)} in {secs:.2f}s{rate})"
            )
        if not todo:
            out.print("nothing to move")
    if failed:
        raise typer.Exit(1)


@contextmanager
def _nullprogress() -> Iterator[None]:
    yield None


def migrations(
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    limit: Annotated[int, typer.Option(help="Most migrations to show")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """Migration history and moves in flight, newest first."""
    with open_engine(load_settings(config, data_dir=data_dir)) as engine:
        rows = [MigrationOut.of(m) for m in engine.migrations(limit=limit)]
    if as_json:
        print_json([r.model_dump(mode="json") for r in rows])
        return
    table = Table("id", "path", "move", "state", "bytes", "seconds", "error")
    for r in rows:
        table.add_row(
            str(r.id),
            r.path,
            f"{r.from_tier} → {r.to_tier}",
            r.state,
            human_size(r.bytes_copied),
            f"{r.duration_s or 0:.2f}",
            r.error or "",
        )
    out.print(table)


def _pin(path: str, tier: str | None, settings: Settings, as_json: bool) -> None:
    with _exclusive(settings, "POST/DELETE /v1/files/{id}/pin") as engine:
        rec = engine.lookup(path)
        rec = engine.pin(rec.id, tier) if tier != "" else engine.unpin(rec.id)
        f = FileOut.of(rec, engine.heat(rec))
    if as_json:
        print_json(f.model_dump(mode="json"))
    elif f.pinned_tier:
        note = "" if f.tier == f.pinned_tier else " (it moves there on the next pass)"
        out.print(f"{f.path} pinned to {f.pinned_tier}{note}")
    else:
        out.print(f"{f.path} unpinned")


def pin(
    path: Annotated[str, typer.Argument(help="File relpath")],
    tier: Annotated[str | None, typer.Option("--tier", help="Default: where it is")] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Pin a file to a tier: policy never moves it elsewhere."""
    _pin(path, tier, load_settings(config, data_dir=data_dir), as_json)


def unpin(
    path: Annotated[str, typer.Argument(help="File relpath")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove a file's pin."""
    _pin(path, "", load_settings(config, data_dir=data_dir), as_json)


def register(cli: typer.Typer) -> None:
    """Add the commands to ``cli``."""
    cli.add_typer(policy_cli, name="policy")
    cli.command()(plan)
    cli.command()(explain)
    cli.command()(migrate)
    cli.command()(migrations)
    cli.command()(pin)
    cli.command()(unpin)
