"""The client installs and works alone: without the server's dependencies, with only the base
dependencies of ``pyproject.toml`` (httpx, numpy), and with one public surface.

The proof runs in a subprocess, against a real tierd serving on loopback from this process. The
subprocess first makes the server's modules unimportable (``sys.modules[name] = None``, as
kvikio's tests prove their optional imports), then refuses every other third-party module that
a client-only install would not have, as if only ``pip install tierd`` had run.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import tierd_client
from app.settings import Settings
from tests.conftest import LiveServer, free_port, make_settings
from tests.helpers import SHM

ROOT = Path(__file__).resolve().parents[2]

# What only the server needs: none of it may be imported by the client.
SERVER_MODULES = (
    "fastapi",
    "sqlalchemy",
    "alembic",
    "uvicorn",
    "watchdog",
    "starlette",
    "pydantic_settings",
    "xxhash",
    "zstandard",
    "typer",
    "prometheus_client",
)

CLIENT_DEPENDENCIES = {"httpx", "numpy"}

# The public surface, as documented in tierd_client's docstring (and app.client's before it).
PUBLIC = {
    "Client",
    "Buffer",
    "Tensors",
    "TierdClientError",
    "TransportError",
    "JobFailed",
    "APIError",
    "InvalidRequest",
    "RangeNotSatisfiable",
    "AuthError",
    "NotFound",
    "Conflict",
    "TooLarge",
    "TooManyRequests",
    "InsufficientSpace",
    "Unavailable",
    "ServerError",
}

DIM = 64  # float32 items per row of the matrix file
ROWS = 100

# Run first in every child: argv[1] is JSON with "blocked" (module names) and "installed" (the
# top-level modules of a client-only install).
PRELUDE = textwrap.dedent(
    """
    import importlib.abc, json, sys

    args = json.loads(sys.argv[1])
    blocked = args["blocked"]
    for name in blocked:
        sys.modules[name] = None  # `import name` now raises ImportError
    installed = set(args["installed"]) | set(sys.stdlib_module_names)


    class ClientOnlyInstall(importlib.abc.MetaPathFinder):
        # Refuses third-party modules that `pip install tierd` does not bring.
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in installed:
                return None  # the usual finders take it from here
            raise ModuleNotFoundError(f"No module named {name!r} (client-only install)", name=name)


    sys.meta_path.insert(0, ClientOnlyInstall())
    """
)

CHILD = PRELUDE + textwrap.dedent(
    """
    import numpy as np
    from tierd_client import Client, NotFound

    expected = np.fromfile(args["local"], dtype=np.float32).reshape(-1, args["dim"])
    with Client(args["url"]) as tierd:
        record = tierd.file(args["path"])
        assert record["size"] == expected.nbytes, record

        # the whole file into POSIX shared memory, by relpath, typed and shaped
        with tierd.load(args["path"], device="cpu", dtype="float32", shape=expected.shape) as buf:
            assert buf.device == "cpu" and buf.shape == expected.shape, buf
            got = np.asarray(buf)
            assert got.base is not None  # a view of the shared memory, not a copy
            assert np.array_equal(got, expected)
            lease = buf.id
            assert lease in {b["buffer_id"] for b in tierd.buffers()["items"]}
        assert lease not in {b["buffer_id"] for b in tierd.buffers()["items"]}, "not released"

        # a byte range, by catalog id
        with tierd.load(record["id"], offset=4 * args["dim"], length=4 * args["dim"]) as buf:
            assert np.asarray(buf).tobytes() == expected[1].tobytes()

        # rows by index, in request order
        with tierd.gather(args["path"], dim=args["dim"], indices=[7, 3, 7]) as rows:
            assert np.array_equal(np.asarray(rows), expected[[7, 3, 7]])

        # a job followed to its end, with the text progress bar (rich is not installed)
        job = tierd.prefetch(args["path"], target="page_cache", wait=True, poll_s=0.02)
        assert job["state"] == "done", job

        # error replies become the client's exceptions
        try:
            tierd.load("no/such/file.bin")
        except NotFound as exc:
            assert exc.status == 404, exc
        else:
            raise AssertionError("loading a missing file did not raise NotFound")

        assert sum(tierd.buffers()["leased_bytes"].values()) == 0

    # Every blocked module is still blocked: nothing imported it for real (an import would have
    # failed), and nothing smuggled in a submodule or the service package.
    assert all(sys.modules.get(name) is None for name in blocked)
    leaked = sorted(
        m for m in sys.modules if m.split(".")[0] in blocked and sys.modules[m] is not None
    )
    assert not leaked, leaked
    assert "app" not in sys.modules and "tiering.catalog" not in sys.modules
    print("child ok")
    """
)


def _pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _closure(requirements: Iterable[str]) -> set[str]:
    """The distributions that installing ``requirements`` brings (as installed here)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        extras = ["", *sorted(req.extras)]
        for spec in requires:
            sub = Requirement(spec)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append(sub)
    return seen


def client_only_modules() -> list[str]:
    """Top-level modules present after ``pip install tierd``: the base dependencies' closure
    and tierd's own packages."""
    dists = _closure(_pyproject()["project"]["dependencies"])
    modules = {
        module
        for module, owners in importlib.metadata.packages_distributions().items()
        if any(canonicalize_name(d) in dists for d in owners)
    }
    return sorted(modules | {"tierd_client", "tiering", "app"})


def run_child(code: str, **args: Any) -> subprocess.CompletedProcess[str]:
    args.setdefault("blocked", list(SERVER_MODULES))
    args.setdefault("installed", client_only_modules())
    return subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )


@pytest.fixture
def settings(data_dir: Path) -> Settings:
    """The server of ``live_server``, without the tier watcher (not needed here)."""
    return make_settings(data_dir, watch=False)


@pytest.fixture
def matrix(live_server: LiveServer, tmp_path: Path) -> tuple[str, Path]:
    """A ``(ROWS, DIM)`` float32 matrix uploaded to the server: its relpath and a local copy."""
    local = tmp_path / "table.f32"
    rows = (np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM) / 7).tobytes()
    local.write_bytes(rows)
    relpath = "emb/table.f32"
    with live_server.client() as http:
        r = http.put("/v1/files/content", params={"path": relpath}, content=rows)
        assert r.status_code == 201, r.text
    return relpath, local


def test_client_works_without_the_server_dependencies(
    live_server: LiveServer, matrix: tuple[str, Path]
) -> None:
    if not os.access(SHM, os.W_OK):
        pytest.skip("cpu leases are POSIX shared memory; /dev/shm is not writable here")
    relpath, local = matrix
    done = run_child(CHILD, url=live_server.url, path=relpath, local=str(local), dim=DIM)
    assert done.returncode == 0, done.stderr
    assert "child ok" in done.stdout
    assert "prefetch page_cache" in done.stderr  # the text progress bar
    with live_server.client() as http:
        leases = http.get("/v1/buffers").json()
    assert leases["items"] == [] and sum(leases["leased_bytes"].values()) == 0


def test_the_child_really_lacks_the_server() -> None:
    # Guard the guard: in the child, the service and the server-only packages do not import.
    code = PRELUDE + textwrap.dedent(
        """
        import httpx, numpy, tierd_client
        for name in ("app.main", "tiering.catalog", "fastapi", "rich", "pydantic", "click"):
            try:
                __import__(name)
            except ImportError:
                continue
            raise AssertionError(f"{name} imported")
        print("child ok")
        """
    )
    done = run_child(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "child ok"


def _name(requirement: str) -> str:
    return canonicalize_name(Requirement(requirement).name)


def test_base_dependencies_are_the_clients_alone() -> None:
    project = _pyproject()["project"]
    assert {_name(r) for r in project["dependencies"]} == CLIENT_DEPENDENCIES
    server = {_name(r) for r in project["optional-dependencies"]["server"]}
    assert {"fastapi", "uvicorn", "sqlalchemy", "alembic", "watchdog", "xxhash"} <= server
    assert project["scripts"]["tierd"] == "app:main"  # explains a missing [server] extra
    wheel = _pyproject()["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert "tierd_client" in wheel["packages"]


def test_public_names() -> None:
    assert set(tierd_client.__all__) == PUBLIC
    assert len(tierd_client.__all__) == len(PUBLIC)
    for name in tierd_client.__all__:
        assert getattr(tierd_client, name).__module__ == "tierd_client", name
    # The old import path gives the same objects.
    import app.client

    assert app.client.__all__ == tierd_client.__all__
    assert all(getattr(app.client, n) is getattr(tierd_client, n) for n in PUBLIC)


def test_private_modules_declare_what_they_export() -> None:
    for path in sorted((ROOT / "tierd_client").glob("_*.py")):
        module = importlib.import_module(f"tierd_client.{path.stem}")
        assert all(hasattr(module, n) for n in module.__all__), path.name


def test_transport_errors_are_the_clients() -> None:
    # Nothing listens on a port just freed: the httpx error is translated once, cause kept.
    url = f"http://127.0.0.1:{free_port()}"
    with (
        tierd_client.Client(url, timeout=5) as tierd,
        pytest.raises(tierd_client.TransportError) as info,
    ):
        tierd.tiers()
    assert isinstance(info.value.__cause__, httpx.HTTPError)
