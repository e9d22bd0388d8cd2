"""Resident copies outlive their last lease (``cpu_resident_bytes`` here: the same policy as
a GPU's ``gpu_resident_bytes``, on shared-memory buffers): a restarted client's shared load is
handed the kept copy; kept copies stay within their budget, least recently used out first;
they go the moment a lease needs the room, and when their file changes or is deleted; and
nobody ever writes one.

A real server (uvicorn on loopback), real tiers and catalog; the loader's residency is looked
at where the REST views do not say which files are kept.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import LiveServer, make_settings, wait_for
from tests.serving.conftest import MiB, leased, shm_segments
from tierd_client import Client, InsufficientSpace
from tiering.io import Device
from tiering.io.buffers import alloc_size

SIZE = 4 * MiB
ALLOC = alloc_size(Device("cpu"), SIZE)


@pytest.fixture
def buffer_settings(data_dir: Path) -> Any:
    # Room for three kept copies of SIZE bytes; four fit the lease budget.
    return make_settings(
        data_dir,
        watch=False,
        buffers={
            "cpu_budget_bytes": 4 * ALLOC,
            "cpu_resident_bytes": 3 * ALLOC,
            "reap_interval_s": 0.05,
        },
    )


@pytest.fixture
def files(upload: Callable[..., int]) -> Iterator[dict[str, tuple[int, bytes]]]:
    out = {}
    for name in "abcd":
        data = os.urandom(SIZE)
        out[name] = (upload(f"k/{name}.bin", data), data)
    yield out


def _kept_ids(server: LiveServer) -> set[int]:
    residency = server.server.config.app.state.loader.residency
    return {e.key.file_id for e in residency.entries()}


def _load_and_release(api: Client, fid: int) -> bool:
    """A shared load, released at once; whether it was handed a resident copy."""
    with api.load(fid, shared=True) as b:
        return bool(b.reused)


def test_a_restarted_client_is_handed_the_kept_copy(api, files, server):
    fid, data = files["a"]
    with Client(server.url) as first, first.load(fid, shared=True) as b:
        name = b.info["handle"]["name"]
        assert not b.reused and b.source == "page_cache"
    # The client is gone: its copy stays, kept by tierd, not leased to anyone.
    view = api.buffers()
    assert view["items"] == [] and leased(api) == 0
    assert view["kept_bytes"] == {"cpu": ALLOC} and view["resident_bytes"] == {"cpu": ALLOC}
    assert view["resident_copies"] == {"cpu": 1}
    assert name in shm_segments()
    metrics = api._http.get("/metrics").text
    assert f'tierd_resident_kept_bytes{{device="cpu"}} {float(ALLOC):.6e}' in metrics
    before = api.stats()["by_source"]
    with Client(server.url) as second, second.load(fid, shared=True) as again:
        assert again.reused and again.source == "memory" and again.read_only
        assert again.info["handle"]["name"] == name
        assert np.asarray(again).tobytes() == data
        # Leased again: its bytes count as leased, not kept, and only once.
        assert leased(api) == ALLOC and api.buffers()["kept_bytes"] == {"cpu": 0}
    after = api.stats()["by_source"]
    assert "memory" not in before and after["memory"]["operations_completed"] == 1
    assert after["memory"]["bytes_transferred"] == 0
    assert {k: v for k, v in after.items() if k != "memory"} == before  # nothing was read


def test_a_kept_copy_is_never_handed_to_a_writer(api, files):
    fid, data = files["a"]
    with api.load(fid, shared=True) as ro:
        name = ro.info["handle"]["name"]
    # A plain load of the same size gets a buffer of its own, never the kept one.
    with api.load(files["b"][0]) as own:
        assert own.info["handle"]["name"] != name and not own.read_only
        np.asarray(own)[:] = 0
    with api.load(fid, shared=True) as again:
        assert again.reused and again.info["handle"]["name"] == name
        assert np.asarray(again).tobytes() == data


def test_least_recently_used_out_first_over_the_budget(api, files, server):
    a, b, c, d = (files[n][0] for n in "abcd")
    for fid in (a, b, c):
        assert not _load_and_release(api, fid)
    assert _kept_ids(server) == {a, b, c}
    assert _load_and_release(api, a)  # a is the most recently used now; b the least
    assert not _load_and_release(api, d)  # a fourth copy: over the budget of three
    assert _kept_ids(server) == {a, c, d}
    assert api.buffers()["kept_bytes"] == {"cpu": 3 * ALLOC}
    assert not _load_and_release(api, b)  # b was let go: read again (and c goes now)
    assert _kept_ids(server) == {a, d, b}


def test_kept_copies_go_when_a_lease_needs_the_room(api, files, server, upload):
    a, b, c, d = (files[n][0] for n in "abcd")
    for fid in (a, b, c):
        _load_and_release(api, fid)
    # One more fits beside the three kept ones; two more need the oldest one's room.
    with api.load(d) as one:
        assert _kept_ids(server) == {a, b, c}
        with api.load(d) as two:
            assert _kept_ids(server) == {b, c}
            assert np.asarray(two).tobytes() == np.asarray(one).tobytes() == files["d"][1]
    # A copy some lease holds is never taken from it: only idle ones go.
    with api.load(b, shared=True) as held:
        big = upload("k/big.bin", os.urandom(3 * SIZE))
        with api.load(big) as three:
            assert _kept_ids(server) == {b} and len(np.asarray(three)) == 3 * SIZE
        assert held.reused and np.asarray(held).tobytes() == files["b"][1]
    # A load that would not fit even with every kept copy gone fails, and costs none of them.
    _load_and_release(api, c)
    kept = _kept_ids(server)
    huge = upload("k/huge.bin", os.urandom(5 * SIZE))
    with pytest.raises(InsufficientSpace):
        api.load(huge)
    assert _kept_ids(server) == kept == {b, c}


@pytest.mark.parametrize("how", ["overwrite", "delete"])
def test_a_changed_or_deleted_file_drops_its_kept_copy(api, files, server, how):
    fid, data = files["a"]
    with api.load(fid, shared=True) as b:
        name = b.info["handle"]["name"]
    assert _kept_ids(server) == {fid}
    http = httpx.Client(base_url=server.url, timeout=30)
    new = os.urandom(SIZE)
    if how == "overwrite":
        r = http.put(
            "/v1/files/content", params={"path": "k/a.bin", "overwrite": "true"}, content=new
        )
    else:
        r = http.delete(f"/v1/files/{fid}")
    http.close()
    assert r.status_code in (200, 204), r.text
    # The reaper's sweep notices without any load asking, and frees the segment.
    wait_for(lambda: _kept_ids(server) == set(), what="the sweep to drop the stale copy")
    wait_for(lambda: name not in shm_segments(), what="the stale copy's segment to go")
    assert api.buffers()["kept_bytes"] == {"cpu": 0}
    if how == "overwrite":
        with api.load(fid, shared=True) as fresh:
            assert not fresh.reused and np.asarray(fresh).tobytes() == new


def test_a_stale_kept_copy_found_by_a_load_is_dropped(api, files, server):
    """The catalog has not noticed (no watcher): the load's own check finds it stale."""
    fid, _ = files["a"]
    _load_and_release(api, fid)
    rec = api.file(fid)
    root = next(t["path"] for t in api.tiers() if t["name"] == rec["tier"])
    path = Path(root) / rec["path"]
    new = os.urandom(SIZE)
    tmp = path.with_name(".new")
    tmp.write_bytes(new)
    os.replace(tmp, path)
    with api.load(fid, shared=True) as fresh:
        assert not fresh.reused and np.asarray(fresh).tobytes() == new
    assert api.buffers()["resident_copies"] == {"cpu": 1}  # the fresh one, kept in turn
