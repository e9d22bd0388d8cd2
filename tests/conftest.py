"""Shared fixtures: real temp tiers, an Alembic-built SQLite catalog, the real app in-process,
and a real uvicorn server on a free loopback port.

The suite runs in parallel (pytest-xdist: `make test` passes ``-n 4 --dist loadfile``; a
plain ``pytest`` runs it in one process). Each worker is a process of its own, running tests in
no fixed order beside the others, so every test keeps to these rules:

- **Ports**: bind port 0 or take :func:`free_port`; never a fixed one (8470, 5432, 9000, ...).
  A server that may lose its free port to another process before binding retries with a new one
  (``tierd_bench._postgres.PgServer`` does).
- **Files**: write under ``tmp_path`` / ``tmp_path_factory`` (a base directory per worker), never
  a fixed path in /tmp or the repository, nor the home directory (a browser's profile
  included: ``--user-data-dir`` under ``tmp_path``). Names in shared places (/dev/shm) carry
  the process id or a random part, and a test counts only its own (``tierd-{pid}-`` segments).
- **Session fixtures** run once per worker, not once per run: they must not write one shared
  place (``tmp_path_factory`` gives each worker its own). A file's tests run on one worker, in
  order (``--dist loadfile``), so a module fixture starts once; tests that depend on the order
  (the README's snippets) stay in one file. A test never relies on another file's tests.
- **PostgreSQL**: ``pg_url`` is a fresh database on the worker's own server; a test that stops
  its server takes ``private_pg`` (its own copy of the worker's migrated cluster). Never stop
  or reconfigure the shared one.
- **Not alone on the machine**: other workers load the cores. Wait for conditions
  (:func:`wait_for`), never for a time; a TTL or timeout that a test must outlive leaves
  seconds of slack; never assert on machine-wide counts (processes, open files, /dev/shm
  usage, the load), only on what the test itself made.
- **Environment**: ``os.environ`` and cwd are per worker; change them with ``monkeypatch``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from app.main import create_app
from app.settings import Settings, get_settings
from tests.helpers import SHM, engine_settings, seeded
from tierd_client._tls import tls_context
from tiering.engine import Engine

# The S3-protocol server (moto on loopback) and object-tier fixtures, and a real PostgreSQL
# (Debian's server on loopback) with the catalog_backend switch, for every test folder.
pytest_plugins = ["tests.s3", "tests.pg_support"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run slow crash loops and big files")


def _gpu_present() -> bool:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow")
    gpu = None
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords:
            if gpu is None:
                gpu = _gpu_present()
            if not gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU and cupy"))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never see the developer's TIERD_* settings."""
    for key in list(os.environ):
        if key.startswith("TIERD_"):
            monkeypatch.delenv(key)


@pytest.fixture(autouse=True)
def _logging_as_found() -> Iterator[None]:
    """Each test leaves logging as it found it: ``tierd serve`` run in-process (a CLI test)
    configures the root logger for a process it believes is its own."""
    root = logging.getLogger()
    loggers = [root, *(lg for lg in logging.Logger.manager.loggerDict.values())]
    saved = [
        (lg, lg.level, lg.propagate, list(lg.handlers))
        for lg in loggers
        if isinstance(lg, logging.Logger)
    ]
    yield
    for lg, level, propagate, handlers in saved:
        lg.setLevel(level)
        lg.propagate = propagate
        lg.handlers[:] = handlers


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    """Fail a test that leaves a thread running (background work must stop with its owner)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while True:
        leaked = [
            t
            for t in threading.enumerate()
            if t not in before and t.is_alive() and not t.name.startswith(("asyncio_", "AnyIO"))
        ]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not leaked, f"test leaked threads: {[t.name for t in leaked]}"


def wait_for(cond: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll ``cond`` until it returns something truthy (returned), or fail after ``timeout``.

    Tests wait for conditions, never for a fixed time: on a loaded 2-core CI machine the
    condition may take long, and on an idle one it is usually met at once.

    The pause between polls grows from 10 ms to 100 ms: most conditions hold within a few
    polls, and one that takes seconds (a fleet job, often asked over HTTP of a tierd process)
    is asked 10 times a second, not 50 (on 2 cores that polling was a visible share of the
    suite's CPU).
    """
    deadline = time.monotonic() + timeout
    pause = 0.01
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(pause)
        pause = min(0.1, pause * 1.5)


def make_settings(root: Path, **overrides: Any) -> Settings:
    overrides.setdefault("access_flush_interval_s", 0.05)
    return seeded(get_settings(data_dir=root, **overrides))


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def settings(data_dir: Path, catalog_overrides: dict[str, Any]) -> Settings:
    return make_settings(data_dir, **catalog_overrides)


@pytest.fixture
def engine(settings: Settings) -> Iterator[Engine]:
    with Engine(settings.engine_config()) as eng:
        yield eng


@pytest.fixture
def client(settings: Settings) -> Iterator[Any]:
    """The real app, in-process, with its lifespan run."""
    from fastapi.testclient import TestClient

    with TestClient(create_app(settings), base_url="http://127.0.0.1") as c:
        yield c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """uvicorn serving the real app on a loopback port, in a thread."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings.model_copy(update={"port": free_port()})
        config = uvicorn.Config(
            create_app(self.settings),
            host="127.0.0.1",
            port=self.settings.port,
            log_level="warning",
            lifespan="on",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test")
        self.url = f"http://127.0.0.1:{self.settings.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, verify=tls_context())


@pytest.fixture
def host_network() -> Iterator[None]:
    """The host's network interfaces, held alone for the test: the fleet bench's namespace tests
    and the benches' tc-paced ``s3like`` origin (as root) add and remove a bridge and veths in
    this namespace, and Chromium fails requests in flight
    (``ERR_NETWORK_CHANGED``) when an interface comes or goes. A lock file, because pytest-xdist
    runs those tests in other processes."""
    import tempfile

    with open(Path(tempfile.gettempdir()) / "tierd-tests-host-network.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture
def live_server(settings: Settings) -> Iterator[LiveServer]:
    with LiveServer(settings) as srv:
        yield srv


def disk_snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (to prove bad input changed nothing)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith("catalog.db")
    }


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        pytest.skip("/dev/shm is not writable here")
    d = SHM / f"tierd-test-{uuid.uuid4().hex[:12]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def esettings(tmp_path: Path, catalog_overrides: dict[str, Any]) -> Settings:
    return engine_settings(tmp_path / "data", **catalog_overrides)


@pytest.fixture
def eng(esettings: Settings) -> Iterator[Engine]:
    """A started engine whose scheduler never fires on its own (tests drive it)."""
    with Engine(esettings.engine_config()) as e:
        yield e
