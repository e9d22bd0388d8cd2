"""Fixtures of the client's tests: one live tierd for the fsspec tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tests.conftest import LiveServer, make_settings

ADMIN, DATA = "fsspec-admin-token", "fsspec-data-token"


@pytest.fixture(scope="session")
def fsspec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A tierd on loopback with both tokens, shared by the fsspec test modules: fsspec's
    abstract suite alone makes about 7,000 requests, and a server per test would double its
    time. Each test works under a directory of its own.

    Started before any test that uses it, so the per-test thread check counts its threads as
    already there; at the end, no thread it started may outlive it.
    """
    before = set(threading.enumerate())
    root = tmp_path_factory.mktemp("fsspec") / "data"
    # No watcher: the tests change the tiers only through the API.
    settings = make_settings(root, admin_token=ADMIN, data_token=DATA, watch=False)
    with LiveServer(settings) as srv:
        yield srv
    deadline = time.monotonic() + 5
    while True:
        leaked = [
            t.name
            for t in threading.enumerate()
            if t not in before and t.is_alive() and not t.name.startswith(("asyncio_", "AnyIO"))
        ]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not leaked, f"the server left threads running: {leaked}"
