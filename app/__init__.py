"""tierd: the service (FastAPI app, CLI, settings) around the tiering engine.

Nothing here is imported eagerly: ``app.client`` must stay importable with only the client's
dependencies (``pip install tierd``), and the ``tierd`` command must explain the missing extra.
"""

from __future__ import annotations

import sys

# What `pip install 'tierd[server]'` adds; a missing one means the extra is not installed.
_SERVER_MODULES = frozenset(
    {
        "fastapi",
        "starlette",
        "uvicorn",
        "sqlalchemy",
        "alembic",
        "pydantic",
        "pydantic_settings",
        "typer",
        "click",
        "rich",
        "xxhash",
        "watchdog",
        "prometheus_client",
    }
)


def main() -> None:
    """The ``tierd`` command: the CLI, or a one-line hint when the server is not installed."""
    try:
        from app.cli import main as cli
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in _SERVER_MODULES:
            raise
        sys.exit(
            f"tierd: the service needs {exc.name}, which is missing: pip install 'tierd[server]'"
        )
    cli()
