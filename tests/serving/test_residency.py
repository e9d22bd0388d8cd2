"""Resident copies on ``cpu``: ``shared=true`` loads hand out one shared-memory segment to
every process that asks, read-only; a changed file is never served from it; the copy goes with
its last lease; and every reply, ``/v1/stats`` and ``/metrics`` say where bytes came from.

A real server (uvicorn on loopback), real tiers and catalog; handles are opened by
tierd_client, in this process and in a second one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.conftest import disk_snapshot, wait_for
from tests.serving.conftest import MiB, leased, shm_segments
from tierd_client import Client, InvalidRequest, NotFound, RangeNotSatisfiable
from tiering.io import Device
from tiering.io.buffers import alloc_size

CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from tierd_client import Client

    args = json.loads(sys.argv[1])
    blob = open(args["file"], "rb").read()
    with Client(args["url"]) as api, api.load(args["id"], shared=True) as b:
        a = np.asarray(b)
        try:
            a[0] = 1
        except ValueError:
            refused = True
        else:
            refused = False
        print(json.dumps({
            "name": b.info["handle"]["name"], "read_only": b.read_only, "reused": b.reused,
            "source": b.source, "refused": refused, "same": a.tobytes() == blob,
        }))
    """
)


def _tier_file(api: Client, fid: int) -> Path:
    rec = api.file(fid)
    root = next(t["path"] for t in api.tiers() if t["name"] == rec["tier"])
    return Path(root) / rec["path"]


def test_shared_loads_hand_out_one_read_only_segment(api, upload, server, tmp_path):
    data = os.urandom(MiB + 12_345)
    fid = upload("w/shared.bin", data)
    (tmp_path / "shared.bin").write_bytes(data)
    first = api.load(fid, shared=True)
    assert first.read_only and not first.reused and first.source == "page_cache"
    assert first.info["handle"]["read_only"] is True
    name = first.info["handle"]["name"]
    one_copy = leased(api)
    # A second process: the same segment, no read, nothing more leased, and NumPy refuses writes.
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    args = {"url": server.url, "id": fid, "file": str(tmp_path / "shared.bin")}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {
        "name": name, "read_only": True, "reused": True, "source": "memory", "refused": True,
        "same": True,
    }  # fmt: skip
    # In this process too: the same segment, and read-only views everywhere.
    second = api.load(fid, shared=True)
    assert second.info["handle"]["name"] == name and second.reused
    assert leased(api) == one_copy
    a = np.asarray(second)
    assert a.tobytes() == data and not a.flags.writeable
    with pytest.raises(ValueError):
        a[0] = 0
    assert memoryview(second.array).readonly
    assert second.__array_interface__["data"][1] is True
    # Releasing one keeps the other readable; releasing both frees the segment.
    first.close()
    assert name in shm_segments() and leased(api) == one_copy
    assert np.asarray(second).tobytes() == data
    second.close()
    assert name not in shm_segments() and leased(api) == 0
    assert server.server.config.app.state.loader.residency.entries() == []


def test_concurrent_shared_loads_read_once(api, upload):
    """N processes starting together: the first reads, the others wait for its copy."""
    data = os.urandom(3 * MiB + 1)
    fid = upload("w/herd.bin", data)
    with ThreadPoolExecutor(8) as pool:
        bufs = list(pool.map(lambda _: api.load(fid, shared=True), range(8)))
    try:
        assert len({b.info["handle"]["name"] for b in bufs}) == 1
        assert sorted(b.reused for b in bufs) == [False] + [True] * 7
        assert leased(api) == alloc_size(Device("cpu"), len(data))
        assert all(np.asarray(b).tobytes() == data for b in bufs)
        by_source = api.stats()["by_source"]
        assert by_source["memory"]["operations_completed"] == 7
        read = [v for k, v in by_source.items() if k != "memory"]
        assert sum(v["operations_completed"] for v in read) == 1
    finally:
        for b in bufs:
            b.close()
    assert leased(api) == 0


def test_a_plain_load_is_never_shared(api, upload):
    fid = upload("w/own.bin", b"\7" * 50_000)
    with api.load(fid, shared=True) as ro, api.load(fid) as own, api.load(fid) as own2:
        assert not own.read_only and not own.reused and own.info["handle"]["read_only"] is False
        assert own.info["handle"]["name"] != ro.info["handle"]["name"]
        assert own2.info["handle"]["name"] != own.info["handle"]["name"]
        arr = np.asarray(own)
        arr[0] = 9  # the client's to write
        assert np.asarray(ro)[0] == 7 and np.asarray(own2)[0] == 7


def test_a_range_inside_a_resident_copy_is_the_same_segment(api, upload):
    data = os.urandom(64 * 1024)
    fid = upload("w/range.bin", data)
    with api.load(fid, shared=True) as whole:
        before = leased(api)
        with api.load(fid, offset=4096, length=8192, dtype="float32", shared=True) as part:
            h = part.info["handle"]
            assert h["name"] == whole.info["handle"]["name"] and h["offset"] == 4096
            assert part.reused and leased(api) == before
            assert np.asarray(part).tobytes() == data[4096 : 4096 + 8192]
        # Not a whole number of items from the copy's start: a copy of its own.
        with api.load(fid, offset=2, length=8, dtype="float32", shared=True) as odd:
            assert not odd.reused and odd.info["handle"]["name"] != whole.info["handle"]["name"]
            assert np.asarray(odd).tobytes() == data[2:10]


@pytest.mark.parametrize("how", ["replace", "in_place"])
def test_a_file_rewritten_behind_tierds_back_is_read_again(api, upload, how):
    old = os.urandom(200_000)
    fid = upload("w/changing.bin", old)
    path = _tier_file(api, fid)
    with api.load(fid, shared=True) as stale:
        new = os.urandom(len(old))  # the same size: only the bytes differ
        if how == "replace":
            tmp = path.with_name(".new")
            tmp.write_bytes(new)
            os.replace(tmp, path)
        else:
            st = path.stat()
            with open(path, "r+b") as f:
                f.write(new)
            # Kernel timestamps are coarse (a jiffy): give the write the later time that a
            # write a moment later would get.
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        assert api.file(fid)["generation"] == 0  # the catalog has not noticed (no watcher)
        with api.load(fid, shared=True) as fresh:
            assert not fresh.reused and fresh.source != "memory"
            assert fresh.info["handle"]["name"] != stale.info["handle"]["name"]
            assert np.asarray(fresh).tobytes() == new
        with api.load(fid, offset=10, length=100, shared=True) as part:
            assert np.asarray(part).tobytes() == new[10:110]
        assert np.asarray(stale).tobytes() == old  # the old lease keeps what it was given


def test_the_copy_goes_with_its_last_lease(api, upload, server):
    fid = upload("w/ttl.bin", b"\3" * 30_000)
    b = api.load(fid, shared=True, ttl_s=0.2, release_on_close=False)
    name = b.info["handle"]["name"]
    wait_for(lambda: name not in shm_segments(), what="the reaper to free the lease")
    b.close()
    residency = server.server.config.app.state.loader.residency
    assert residency.entries() == [] and leased(api) == 0
    with api.load(fid, shared=True) as again:
        assert not again.reused and again.source == "page_cache"


def test_gpu_prefetch_into_cpu_is_a_resident_copy(api, upload):
    data = os.urandom(100_000)
    fid = upload("w/warm.bin", data)
    job = api.prefetch([fid], target="gpu", device="cpu", wait=True, progress=False)
    (warm_id,) = job["buffer_ids"]
    warm = api.request("GET", f"/v1/buffers/{warm_id}")
    assert warm["read_only"] is True and warm["source"] == "page_cache"
    with api.load(fid, shared=True) as b:
        assert b.reused and b.info["handle"]["name"] == warm["handle"]["name"]
        assert np.asarray(b).tobytes() == data
    # A second prefetch of a resident file is handed the same copy: nothing read again.
    job2 = api.prefetch([fid], target="gpu", device="cpu", wait=True, progress=False)
    again = api.request("GET", f"/v1/buffers/{job2['buffer_ids'][0]}")
    assert again["reused"] is True and again["handle"]["name"] == warm["handle"]["name"]
    api.release(warm_id)
    api.release(job2["buffer_ids"][0])
    assert leased(api) == 0


def test_shared_batch_reads_each_content_once(api, upload):
    a, b = os.urandom(10_000), os.urandom(20_000)
    fa, fb = upload("w/a.bin", a), upload("w/b.bin", b)
    bufs = api.load_batch([fa, fb, fa, {"file": fb, "offset": 4, "length": 8}], shared=True)
    try:
        names = [x.info["handle"]["name"] for x in bufs]
        assert names[0] == names[2] and names[1] == names[3] and names[0] != names[1]
        assert bufs[3].info["handle"]["offset"] == 4
        cpu = Device("cpu")
        assert leased(api) == alloc_size(cpu, 10_000) + alloc_size(cpu, 20_000)
        assert [np.asarray(x).tobytes() for x in bufs] == [a, b, a, b[4:12]]
        assert all(x.read_only for x in bufs)
    finally:
        for x in bufs:
            x.close()
    assert leased(api) == 0


def _shards(tmp_path: Path) -> tuple[dict[str, np.ndarray], list[bytes]]:
    rng = np.random.default_rng(1)
    tensors = {
        "a": rng.standard_normal((64, 32)).astype(np.float32),
        "b": np.arange(100, dtype=np.int64),
        "c": rng.integers(0, 255, (5, 7), dtype=np.uint8),
    }
    out = []
    for i, names in enumerate((["a", "b"], ["c"])):
        p = tmp_path / f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in names}, str(p))
        out.append(p.read_bytes())
    return tensors, out


def test_shared_safetensors_and_model_loads(api, upload, tmp_path):
    tensors, blobs = _shards(tmp_path)
    ids = [
        upload(f"models/m/model-0000{i + 1}-of-00002.safetensors", b) for i, b in enumerate(blobs)
    ]
    with api.load_safetensors(ids, shared=True) as first:
        before = leased(api)
        names = sorted(x.info["handle"]["name"] for x in first.buffers)
        with api.load_model("models/m", shared=True) as second:
            assert sorted(x.info["handle"]["name"] for x in second.buffers) == names
            assert all(x.reused and x.read_only for x in second.buffers)
            assert leased(api) == before
            for k, v in tensors.items():
                assert np.array_equal(second[k], v), k
                assert not second[k].flags.writeable
        # Another selection of a resident shard is in its copy already: handed out of the
        # same allocation at its tensors' offsets (no read, no new bytes).
        with api.load_safetensors(ids, names=["b"], shared=True) as in_it:
            (buf,) = in_it.buffers
            assert buf.reused and buf.info["handle"]["name"] in names
            assert leased(api) == before
            assert np.array_equal(in_it["b"], tensors["b"])
    assert leased(api) == 0
    # With nothing resident, a selection is a content of its own: read, then handed out again.
    with api.load_safetensors(ids, names=["b"], shared=True) as only_b:
        (buf,) = only_b.buffers
        assert not buf.reused and buf.info["handle"]["name"] not in names
        assert np.array_equal(only_b["b"], tensors["b"])
        with api.load_safetensors(ids, names=["b"], shared=True) as again:
            assert again.buffers[0].reused
            assert again.buffers[0].info["handle"]["name"] == buf.info["handle"]["name"]
    assert leased(api) == 0


def test_shared_state_dict_tensors(api, upload, tmp_path):
    torch = pytest.importorskip("torch")
    tensors, blobs = _shards(tmp_path)
    for i, b in enumerate(blobs):
        upload(f"models/sd/model-0000{i + 1}-of-00002.safetensors", b)
    with api.load_model("models/sd", shared=True) as held:
        one_copy = leased(api)
        sd = api.load_state_dict("models/sd", shared=True)
        assert leased(api) == one_copy  # the same resident shards, handed out again
        for k, v in tensors.items():
            assert torch.equal(sd[k], torch.from_numpy(v)), k
            assert np.array_equal(held[k], v)
        del sd


def test_source_in_replies_stats_history_and_metrics(api, upload):
    fid = upload("w/src.bin", b"\5" * 300_000)
    with api.load(fid) as plain:
        assert plain.source == "page_cache" and plain.info["io_path"] == "host"
    with api.load(fid, shared=True), api.load(fid, shared=True) as hit:
        assert hit.source == "memory" and hit.info["io_path"] == "copy"
        assert hit.info["gbps"] == 0.0
    s = api.stats()
    assert s["by_source"]["page_cache"]["bytes_transferred"] == 600_000
    assert s["by_source"]["memory"]["operations_completed"] == 1
    assert s["by_source"]["memory"]["bytes_transferred"] == 0
    assert s["by_tier_source"]["nvme/page_cache"]["operations_completed"] == 2
    hist = api.request("GET", "/v1/stats/history", params={"minutes": 1})
    assert hist["points"][-1]["by_source"]["page_cache"]["bytes"] == 600_000
    text = api._http.get("/metrics").text
    assert 'tierd_loads_by_source_total{source="memory",tier="nvme"} 1.0' in text
    assert 'tierd_loads_by_source_total{source="page_cache",tier="nvme"} 2.0' in text
    assert 'tierd_loaded_bytes_by_source_total{source="page_cache",tier="nvme"} 600000.0' in text
    assert 'tierd_loaded_bytes_total{device="cpu",io_path="host",op="load",tier="nvme"}' in text
    assert "tierd_resident_bytes" in text


def test_bad_shared_input_changes_nothing(api, upload, server, data_dir):
    fid = upload("w/bad.bin", b"\1" * 5000)
    http = api._http
    residency = server.server.config.app.state.loader.residency
    before = shm_segments()
    disk = disk_snapshot(data_dir)
    accesses = api.file(fid)["access_count"]
    for body in (
        {"file_id": fid, "shared": "yes"},
        {"file_id": fid, "shared": 1},
        {"file_id": fid, "shared": None},
    ):
        r = http.post("/v1/load", json=body)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"]
    for route, body in (
        ("/v1/load/batch", {"items": [{"file_id": fid}], "shared": "true"}),
        ("/v1/load/safetensors", {"file_ids": [fid], "shared": "no"}),
        ("/v1/models/load?name=w", {"shared": 0}),
        ("/v1/load/safetensors", {"file_ids": [fid], "wait": "no"}),
        ("/v1/models/load?name=w", {"wait": 0}),
    ):
        r = http.post(route, json=body)
        assert r.status_code == 422 and r.json()["error"]["code"], (route, r.text)
    with pytest.raises(RangeNotSatisfiable):
        api.load(fid, offset=5001, shared=True)
    with pytest.raises(NotFound):
        api.load("w/none.bin", shared=True)
    with pytest.raises(InvalidRequest):
        api.load(fid, dtype="complex128", shared=True)  # 5000 bytes: no whole number of them
    with pytest.raises(InvalidRequest):
        api.load(fid, device="cuda:99", shared=True)
    # All or nothing: one bad item leaves nothing leased or resident.
    with pytest.raises(RangeNotSatisfiable):
        api.load_batch([fid, {"file": fid, "offset": 9000}], shared=True)
    assert leased(api) == 0 and residency.entries() == [] and shm_segments() == before
    assert disk_snapshot(data_dir) == disk
    # No access was counted: one good load after them is the only one (accesses are flushed
    # in order, in batches).
    api.load(fid, shared=True).close()
    wait_for(lambda: api.file(fid)["access_count"] > accesses, what="the access to be flushed")
    assert api.file(fid)["access_count"] == accesses + 1


def test_over_budget_shared_load_is_507_and_leaves_nothing(api, upload, server):
    fid = upload("w/big.bin", b"\0" * (40 * MiB))
    with api.load(fid, shared=True) as b:
        assert b.reused is False
        with api.load(fid, shared=True) as again:  # within budget: the same copy
            assert again.reused
        # The budget (64 MiB) has no room for a second copy of a rewritten file.
        path = _tier_file(api, fid)
        st = path.stat()
        with open(path, "r+b") as f:
            f.write(b"\1")
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        r = api._http.post("/v1/load", json={"file_id": fid, "shared": True})
        assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_space"
    assert leased(api) == 0
    assert server.server.config.app.state.loader.residency.entries() == []
