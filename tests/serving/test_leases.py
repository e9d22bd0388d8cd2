"""Leases: TTL and the reaper, renew, release, shutdown, and the budget under concurrency."""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.conftest import LiveServer, make_settings
from tests.serving.conftest import MiB, leased, shm_segments
from tierd_client import InsufficientSpace, NotFound, ServerError


def _wait(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_expired_lease_is_freed_by_the_reaper(api, upload):
    fid = upload("t.bin", b"t" * 10_000)
    b = api.load(fid, ttl_s=0.2)
    name = b.info["handle"]["name"]
    assert name in shm_segments()
    assert _wait(lambda: name not in shm_segments())
    with pytest.raises(NotFound):
        api.renew(b.id)
    assert leased(api) == 0
    b.close()  # releasing an expired lease is not an error
    text = api._http.get("/metrics").text
    assert "tierd_leases_expired_total 1.0" in text


def test_renew_keeps_a_lease_alive(api, upload):
    fid = upload("r.bin", b"r" * 10_000)
    # Renewed every 0.3 s for 1.8 s in all, past its 1 s TTL: 0.7 s of slack for a renewal
    # that comes late on a loaded 2-core machine (0.2 s of 0.4 was not always enough).
    with api.load(fid, ttl_s=1.0) as b:
        first = b.expires_at
        for _ in range(6):
            time.sleep(0.3)
            b.renew()  # the lease's own ttl again
        assert b.expires_at > first
        assert api.buffers()["items"][0]["buffer_id"] == b.id
        longer = api.renew(b.id, ttl_s=60)
        assert longer["ttl_s"] == 60
        assert np.asarray(b).tobytes() == b"r" * 10_000


def test_release_frees_at_once(api, upload):
    fid = upload("d.bin", b"d" * 10_000)
    b = api.load(fid)
    name = b.info["handle"]["name"]
    api.release(b.id)
    assert name not in shm_segments() and leased(api) == 0
    with pytest.raises(NotFound) as err:
        api.release(b.id)
    assert err.value.code == "buffer_not_found" and b.id in err.value.message
    b.close()


def test_a_lease_outlives_its_deleted_file_and_the_list_says_it_is_gone(api, upload, server):
    kept, gone = upload("kept.bin", b"k" * 4096), upload("gone.bin", b"g" * 4096)
    with api.load(kept) as k, api.load(gone) as g:
        r = httpx.delete(f"{server.url}/v1/files/{gone}", timeout=30)
        assert r.status_code == 200, r.text
        # The buffer is the client's: deleting its file neither frees nor changes it...
        assert np.asarray(g).tobytes() == b"g" * 4096
        # ...and the list, the dashboard's source, no longer shows it as a live file's.
        items = {i["buffer_id"]: i for i in api.buffers()["items"]}
        assert items[g.id]["file_ids"] == [gone] and items[g.id]["deleted_file_ids"] == [gone]
        assert items[k.id]["deleted_file_ids"] == []
        one = httpx.get(f"{server.url}/v1/buffers/{g.id}", timeout=30).json()
        assert one["deleted_file_ids"] == [gone]
        assert api.renew(g.id)["buffer_id"] == g.id  # still the client's to keep
    assert leased(api) == 0


def test_released_segments_wait_renamed_and_serve_the_next_lease(api, upload, server):
    data = os.urandom(3 * MiB + 5)
    fid = upload("p.bin", data)
    first = api.load(fid)
    name = first.info["handle"]["name"]
    api.release(first.id)
    first.close()
    # The released name stops opening at once; the pages wait under an idle name.
    assert name not in shm_segments(idle=True)
    (waiting,) = shm_segments(idle=True) - shm_segments()
    pool = server.server.config.app.state.loader.leases.pool
    assert pool.idle_bytes()["cpu"] == 3 * MiB + 4096
    with api.load(fid) as again:  # the same size: the same pages, under a fresh name
        fresh = again.info["handle"]["name"]
        assert fresh not in (name, waiting) and fresh in shm_segments()
        assert waiting not in shm_segments(idle=True) and pool.idle_bytes()["cpu"] == 0
        assert np.asarray(again).tobytes() == data
    with pytest.raises(FileNotFoundError):
        os.stat(f"/dev/shm/{name}")


def test_shutdown_frees_every_lease(buffer_settings, data_dir):
    before = shm_segments(idle=True)
    with LiveServer(buffer_settings) as srv:
        http = httpx.Client(base_url=srv.url)
        fid = http.put("/v1/files/content", params={"path": "s.bin"}, content=b"s" * 9000).json()[
            "id"
        ]
        for _ in range(3):
            assert http.post("/v1/load", json={"file_id": fid, "ttl_s": 3600}).status_code == 200
        assert len(shm_segments() - before) == 3
        http.close()
    assert shm_segments(idle=True) - before == set()


def test_budget_holds_under_concurrent_requests(data_dir):
    budget = 8 * MiB
    settings = make_settings(data_dir, watch=False, buffers={"cpu_budget_bytes": budget})
    with LiveServer(settings) as srv:
        http = httpx.Client(base_url=srv.url, timeout=30)
        fid = http.put("/v1/files/content", params={"path": "c.bin"}, content=b"c" * MiB).json()[
            "id"
        ]
        loader = srv.server.config.app.state.loader  # the server runs in this process
        peak = 0
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, loader.leases.leased_bytes().get("cpu", 0))

        sampler = threading.Thread(target=sample)
        sampler.start()

        def one(_: int) -> int:
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                return c.post("/v1/load", json={"file_id": fid}).status_code

        with ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(one, range(48)))
        stop.set()
        sampler.join()
        assert codes.count(200) == 8 and codes.count(507) == 40
        assert peak <= budget
        assert loader.leases.leased_bytes()["cpu"] == budget
        for item in http.get("/v1/buffers").json()["items"]:
            http.delete(f"/v1/buffers/{item['buffer_id']}")
        assert loader.leases.leased_bytes()["cpu"] == 0
        http.close()


def test_read_error_leaks_nothing(api, upload, monkeypatch):
    fid = upload("e.bin", b"e" * 300_000)
    real = os.preadv

    def failing(fd, buffers, offset, *a):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(ServerError) as err:
        api.load(fid)
    assert err.value.status == 500 and "injected" in err.value.message
    with pytest.raises(ServerError):
        api.gather(fid, dim=4, dtype="uint8", start=0, count=10)
    monkeypatch.setattr(os, "preadv", real)
    assert leased(api) == 0 and not shm_segments()


def test_client_raises_typed_errors_with_the_server_message(api, upload):
    fid = upload("b.bin", b"b" * (40 * MiB))
    keep = api.load(fid)
    with pytest.raises(InsufficientSpace) as err:
        api.load(fid)
    assert err.value.status == 507 and err.value.details["free"] == 24 * MiB
    assert "24" in str(err.value.details["free"]) and "budget" in err.value.message
    keep.close()
    assert leased(api) == 0
