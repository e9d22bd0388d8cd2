"""Real tierd processes for the fleet's tests: ``tierd serve`` in a subprocess of its own, with
its own host id and data directory, configured by environment only (``TIERD_*``, complex values
as JSON, as pydantic-settings reads them), so a test can kill -9 one and start it again.

Three of them sharing one PostgreSQL catalog and one bucket are a fleet on loopback: each
process is a host as far as tierd can tell (its own tiers, memory, leases and threads); only
the machine under them is shared.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import LiveServer, free_port
from tests.s3 import REGION
from tierd_client._tls import tls_context

__all__ = ["TierdProcess", "fleet_of", "live_pair", "object_tier"]

_CODE = "import sys\nfrom app import main\nsys.argv[0] = 'tierd'\nsys.exit(main())"


def _env_value(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v, default=str)


class TierdProcess:
    """One ``tierd serve`` on a loopback port; ``start``, ``kill9``, ``stop``, ``client``."""

    def __init__(self, root: Path, host_id: str, settings: Mapping[str, Any]) -> None:
        self.root = root
        self.host_id = host_id
        root.mkdir(parents=True, exist_ok=True)
        self.log = root / "tierd.log"
        self.settings = {
            "data_dir": str(root),
            "host": "127.0.0.1",
            "host_id": host_id,
            "watch": False,
            **settings,
        }
        self._new_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_at = 0

    def _new_port(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings.update(port=self.port, advertise_url=self.url)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
        env.update({f"TIERD_{k.upper()}": _env_value(v) for k, v in self.settings.items()})
        # Each tierd process would otherwise compile app and tiering again (a second of CPU a
        # start) where the environment says not to cache bytecode (this machine's default):
        # the first start writes the cache (atomically), the rest read it, as `make test` does.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        return env

    def start(self, *, timeout: float = 60.0) -> TierdProcess:
        return self.launch().wait_ready(timeout=timeout)

    def launch(self) -> TierdProcess:
        """Start the process; :meth:`wait_ready` waits for it to serve."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with self.log.open("ab") as log:
            self._log_at = log.tell()
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _CODE, "serve"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=self.root,
            )
        return self

    def wait_ready(self, *, timeout: float = 60.0) -> TierdProcess:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        # One client for the whole wait: a client per poll loaded the CA bundle each time (35 ms
        # of CPU), 15% of a fleet test's CPU (py-spy) on the 2-core machine.
        with httpx.Client(timeout=2, verify=tls_context()) as http:
            return self._wait_ready(http, deadline)

    def _wait_ready(self, http: httpx.Client, deadline: float) -> TierdProcess:
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None and self._lost_port():
                # Another process (an xdist worker's) took the free port between free_port()
                # and this server's bind: the same host again on another port.
                self._new_port()
                self.launch()
                continue
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"tierd {self.host_id} exited {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if http.get(f"{self.url}/healthz").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill9()
                raise AssertionError(f"tierd {self.host_id} did not start:\n{self.log_tail()}")
            time.sleep(0.05)

    def _lost_port(self) -> bool:
        try:
            with self.log.open("rb") as f:
                f.seek(self._log_at)
                return b"address already in use" in f.read()
        except OSError:
            return False

    def kill9(self) -> None:
        """SIGKILL, as a crash: nothing of tierd's runs after it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill9()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, verify=tls_context())

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def object_tier(endpoint: str, bucket: str, prefix: str = "models") -> dict[str, Any]:
    return {
        "name": "s3",
        "url": f"s3://{bucket}/{prefix}",
        "endpoint_url": endpoint,
        "region": REGION,
        "connections": 4,
    }


@contextmanager
def fleet_of(
    base: Path,
    n: int,
    *,
    catalog_url: str,
    endpoint: str,
    bucket: str,
    settings: Mapping[str, Any] | None = None,
    endpoints: Mapping[int, str] | None = None,
    memory_bytes: int = 0,
) -> Iterator[list[TierdProcess]]:
    """``n`` tierd processes, ``host-0`` ... , each with an ``nvme`` directory tier of its own
    above the shared bucket tier ``s3``, on one catalog; the first started alone (it upgrades
    the schema), then the others together; stopped at the end whatever happened.
    ``endpoints`` gives a host another way to the bucket (a fault proxy in front of the same
    server); ``memory_bytes``, a memory tier of that quota above them on every host."""
    memory = (
        [{"name": "ram", "kind": "memory", "quota_bytes": memory_bytes}] if memory_bytes else []
    )
    procs = []
    for i in range(n):
        root = base / f"host-{i}"
        procs.append(
            TierdProcess(
                root,
                f"host-{i}",
                {
                    "catalog_url": catalog_url,
                    "heartbeat_interval_s": 0.2,
                    "access_flush_interval_s": 0.1,
                    "tiers": [
                        *memory,
                        {"name": "nvme", "path": str(root / "nvme")},
                        object_tier((endpoints or {}).get(i, endpoint), bucket),
                    ],
                    "buffers": {"cpu_budget_bytes": 64 << 20},
                    **(settings or {}),
                },
            )
        )
    with ExitStack() as stack:
        for p in procs:
            stack.callback(p.stop)
        # The first upgrades the catalog's schema; the others start together after it.
        procs[0].start()
        for p in procs[1:]:
            p.launch()
        for p in procs[1:]:
            p.wait_ready()
        yield procs


@contextmanager
def live_pair(
    root: Path,
    objects: Mapping[str, bytes],
    s3_client: Any,
    bucket: str,
    settings_of: Callable[[Path, str], Any],
) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """Two real tierd servers in this process (uvicorn on loopback), ``host-a`` and ``host-b``,
    each with the settings ``settings_of(its root, its host id)`` gives, once ``objects`` are
    in the bucket under ``models/``; yields a client of each."""
    for rel, data in objects.items():
        s3_client.put_object(Bucket=bucket, Key=f"models/{rel}", Body=data)
    sa, sb = settings_of(root / "a", "host-a"), settings_of(root / "b", "host-b")
    with LiveServer(sa) as a, LiveServer(sb) as b, a.client() as ca, b.client() as cb:
        yield ca, cb
