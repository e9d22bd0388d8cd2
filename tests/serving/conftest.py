"""Fixtures of the buffer tests: a real server with small lease budgets, and files in it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LiveServer, make_settings
from tierd_client import Client
from tiering.io.shm import idle_prefix

MiB = 1 << 20


def shm_segments(*, idle: bool = False) -> set[str]:
    """tierd's shared-memory segments of this process (the server runs in it): those of live
    leases, and with ``idle`` also the released ones waiting in the pool for reuse."""
    prefix = f"tierd-{os.getpid()}-"
    waiting = idle_prefix()
    return {
        n
        for n in os.listdir("/dev/shm")
        if n.startswith(prefix) and (idle or not n.startswith(waiting))
    }


@pytest.fixture
def buffer_settings(data_dir: Path) -> Any:
    return make_settings(
        data_dir,
        watch=False,
        buffers={"cpu_budget_bytes": 64 * MiB, "reap_interval_s": 0.05, "max_gather_indices": 1000},
    )


@pytest.fixture
def server(buffer_settings: Any) -> Iterator[LiveServer]:
    before = shm_segments(idle=True)
    with LiveServer(buffer_settings) as srv:
        yield srv
    # Shutdown frees every lease and empties the pool: no segment outlives the server.
    assert shm_segments(idle=True) - before == set()


@pytest.fixture
def api(server: LiveServer) -> Iterator[Client]:
    with Client(server.url) as c:
        yield c


@pytest.fixture
def upload(server: LiveServer) -> Iterator[Callable[..., int]]:
    """``upload(relpath, data, tier=None) -> file id``."""
    http = httpx.Client(base_url=server.url, timeout=30)

    def put(relpath: str, data: bytes, tier: str | None = None) -> int:
        params = {"path": relpath, **({"tier": tier} if tier else {})}
        r = http.put("/v1/files/content", params=params, content=data)
        assert r.status_code == 201, r.text
        return int(r.json()["id"])

    yield put
    http.close()


def leased(api: Client) -> int:
    return sum(api.buffers()["leased_bytes"].values())
