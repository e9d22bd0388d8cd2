"""Concurrent loads of one shard read it once (issue 39, point 4; tiering.serving.sharedreads).

Two clients ask for the same model at the same moment, as the processes of a replica group do:
the first load reads the shards, the second copies them out of its buffer, and the page cache
gives the bytes once. The disk is made slow (``os.preadv`` sleeps: a fault injected, nothing of
tierd's replaced) so the second load surely arrives while the first one reads.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.conftest import LiveServer, make_settings
from tierd_client import Client


def _model(tmp_path: Path) -> tuple[dict[str, np.ndarray], list[bytes]]:
    rng = np.random.default_rng(11)
    tensors = {
        "a": rng.standard_normal((128, 64)).astype(np.float32),
        "b": np.arange(5000, dtype=np.int64),
        "c": rng.integers(0, 255, (77, 13), dtype=np.uint8),
    }
    out = []
    for i, names in enumerate((["a", "b"], ["c"])):
        p = tmp_path / f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in names}, str(p))
        out.append(p.read_bytes())
    return tensors, out


def _read_bytes(api: Client) -> int:
    return int(api.stats()["by_source"].get("page_cache", {}).get("bytes_transferred", 0))


@pytest.fixture
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every ``preadv`` waits 1 s until the returned event is set."""
    real = os.preadv
    fast = threading.Event()

    def preadv(fd: int, buffers: object, offset: int, *args: object) -> int:
        if not fast.is_set():
            time.sleep(1.0)
        return real(fd, buffers, offset, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "preadv", preadv)
    return fast


def test_two_concurrent_loads_of_a_model_read_it_once(server, upload, tmp_path, slow_disk):
    tensors, blobs = _model(tmp_path)
    for i, b in enumerate(blobs):
        upload(f"models/s/model-0000{i + 1}-of-00002.safetensors", b)
    results: dict[int, dict[str, object]] = {}

    def load(k: int) -> None:
        with Client(server.url) as api, api.load_model("models/s") as got:
            results[k] = {
                "same": all(np.array_equal(got[n], v) for n, v in tensors.items()),
                "paths": sorted(b.info["io_path"] for b in got.buffers),
            }

    with Client(server.url) as api:
        before = _read_bytes(api)
        first = threading.Thread(target=load, args=(1,))
        first.start()
        time.sleep(0.15)  # the first is reading now (each read waits 1 s)
        load(2)
        first.join()
        read = _read_bytes(api) - before
    assert results[1]["same"] and results[2]["same"]
    # One read the shards, the other copied its buffers (which came first is the host's).
    assert sorted([results[1]["paths"], results[2]["paths"]]) == [["copy"] * 2, ["host"] * 2]
    data = sum(v.nbytes for v in tensors.values())
    assert read == data  # the page cache gave the tensors' bytes once

    # One after the other, nobody follows: each load reads for itself.
    slow_disk.set()
    with Client(server.url) as api:
        before = _read_bytes(api)
        load(3)
        load(4)
        assert _read_bytes(api) - before == 2 * data
    assert results[3]["paths"] == results[4]["paths"] == ["host", "host"]


@pytest.mark.gpu
def test_concurrent_gpu_loads_follow_one_read(data_dir, tmp_path, slow_disk):
    """Into ``cuda:0``, on tierd's own ``host`` engine of local reads (``io.backend``: its
    ``preadv`` is where the slow disk waits; KvikIO's reads are C++'s): the second load follows
    the first one's read, device to device, and its copy has every byte right, checked in a
    second process (a process cannot open its own CUDA IPC handles)."""
    from tests.serving.test_residency_gpu import _child

    rng = np.random.default_rng(2)
    tensors = {f"w{i}": rng.standard_normal((1024, 1024)).astype(np.float32) for i in range(8)}
    p = tmp_path / "model-00001-of-00001.safetensors"
    save_file(tensors, str(p))
    blob = p.read_bytes()
    data = tmp_path / "data.bin"  # the shard's tensors: what its buffer holds
    data.write_bytes(blob[8 + int.from_bytes(blob[:8], "little") :])
    settings = make_settings(data_dir, watch=False, io={"backend": "host"})
    body = {"paths": ["models/g/model-00001-of-00001.safetensors"], "device": "cuda:0"}
    with LiveServer(settings) as server, server.client() as http:
        r = http.put("/v1/files/content", params={"path": body["paths"][0]}, content=blob)
        assert r.status_code == 201, r.text
        replies: dict[int, dict[str, object]] = {}

        def load(k: int) -> None:
            with server.client() as c:
                r = c.post("/v1/load/safetensors", json=body)
                assert r.status_code == 200, r.text
                replies[k] = r.json()["buffers"][0]

        first = threading.Thread(target=load, args=(1,))
        first.start()
        time.sleep(0.15)  # the first is reading now (each read waits 1 s)
        load(2)
        first.join()
        slow_disk.set()
        assert sorted(str(b["io_path"]) for b in replies.values()) == ["copy", "host"], replies
        ids = [str(b["buffer_id"]) for b in replies.values()]
        seen = _child(server, data, ids)
        assert all(seen[i]["same"] for i in ids), seen
        for i in ids:
            assert http.delete(f"/v1/buffers/{i}").status_code == 200
