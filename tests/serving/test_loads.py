"""Loads over REST on the cpu device: every load endpoint, opened in a second process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.serving.conftest import leased
from tierd_client import Buffer, Client

KiB = 1 << 10

CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from tierd_client import Client

    args = json.loads(sys.argv[1])
    blob = open(args["file"], "rb").read()
    with Client(args["url"]) as api:
        # A byte range with a dtype and a shape.
        with api.load(args["id"], offset=96, length=8000, dtype="float32", shape=[-1, 10]) as b:
            a = np.asarray(b)
            assert a.shape == (200, 10) and a.dtype == np.float32
            assert a.tobytes() == blob[96:8096]
        # The whole file by relpath.
        with api.load(args["path"]) as b:
            assert np.asarray(b).tobytes() == blob
        # Rows of the file seen as a (rows, 16) float32 matrix.
        m = np.frombuffer(blob, dtype=np.float32).reshape(-1, 16)
        idx = [5, 0, 99, 5, 42]
        with api.gather(args["id"], dim=16, indices=idx) as b:
            assert np.asarray(b).tobytes() == m[idx].tobytes()
        with api.gather(args["id"], dim=16, start=10, count=7) as b:
            assert np.asarray(b).tobytes() == m[10:17].tobytes()
        # A batch, all or nothing.
        bufs = api.load_batch([args["id"], {"file": args["path"], "offset": 1, "length": 3}])
        assert np.asarray(bufs[0]).tobytes() == blob
        assert np.asarray(bufs[1]).tobytes() == blob[1:4]
        for b in bufs:
            b.close()
        # safetensors shards: named tensors, two shards.
        with api.load_safetensors(args["shards"]) as t:
            want = {k: np.load(v) for k, v in args["tensors"].items()}
            assert sorted(t) == sorted(want)
            for k, v in want.items():
                assert np.array_equal(t[k], v), k
        assert sum(api.buffers()["leased_bytes"].values()) == 0
    print("child ok")
    """
)


@pytest.fixture
def blob() -> bytes:
    return os.urandom(64 * 16 * 4 * 2)  # 128 rows of 16 float32


def test_second_process_opens_every_kind_of_buffer(api, upload, blob, server, tmp_path):
    fid = upload("data/m.bin", blob)
    local = tmp_path / "m.bin"
    local.write_bytes(blob)
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": np.arange(7, dtype=np.int64),
        "c": rng.integers(0, 255, (2, 2, 3), dtype=np.uint8),
    }
    shard_ids = []
    for i, names in enumerate((["a", "b"], ["c"])):
        p = tmp_path / f"s{i}.safetensors"
        save_file({k: tensors[k] for k in names}, str(p))
        shard_ids.append(upload(f"model/s{i}.safetensors", p.read_bytes()))
    npy = {}
    for k, v in tensors.items():
        np.save(tmp_path / f"{k}.npy", v)
        npy[k] = str(tmp_path / f"{k}.npy")
    args = {
        "url": server.url,
        "id": fid,
        "path": "data/m.bin",
        "file": str(local),
        "shards": shard_ids,
        "tensors": npy,
    }
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "child ok" in done.stdout
    assert leased(api) == 0


def test_cpu_buffer_is_zero_copy(api, upload):
    data = bytes(range(256)) * 64
    fid = upload("z.bin", data)
    with api.load(fid, dtype="uint16") as b:
        a = np.asarray(b)
        assert np.shares_memory(a, b.array)
        assert a.tobytes() == data
        assert b.__dlpack_device__() == (1, 0)  # kDLCPU
        assert not hasattr(b, "__cuda_array_interface__")
        if sys.version_info >= (3, 12):
            assert bytes(memoryview(b)) == data
        a[0] = 7  # the client's own memory: writable, nothing else sees it
    assert leased(api) == 0


def test_closing_keeps_live_views_mapped(api, upload):
    fid = upload("v.bin", b"x" * 5000)
    b = api.load(fid)
    keep = np.asarray(b)
    attached = b._attached
    b.close()  # releases the lease: the server unlinks its segment
    assert b.closed and attached is not None and attached.mapped
    with pytest.raises(Exception, match="closed"):
        b.array  # noqa: B018
    del b
    assert keep.tobytes() == b"x" * 5000  # the view still reads its mapping
    assert leased(api) == 0
    del keep
    assert not attached.mapped


def test_lease_fields(api, upload):
    fid = upload("f.bin", b"\0" * 10_000)
    with api.load(fid, offset=16, length=800, dtype="float64", shape=[10, 10]) as b:
        info = b.info
        assert info["nbytes"] == 800 and info["alloc_bytes"] % 4096 == 0
        assert info["shape"] == [10, 10] and info["dtype"] == "float64"
        assert info["handle"]["kind"] == "shm" and info["handle"]["offset"] == 0
        assert info["io_path"] == "host" and info["tier"] == "nvme"
        assert info["gbps"] >= 0 and info["expires_at"] > info["created_at"]
        assert info["file_ids"] == [fid]


def test_zero_length_load(api, upload):
    fid = upload("e.bin", b"abc")
    with api.load(fid, offset=3) as b:
        assert b.nbytes == 0 and np.asarray(b).size == 0


def test_every_file_touched_counts_one_access(api, upload, tmp_path, server):
    fid = upload("acc.bin", b"\1" * 4096)
    save_file({"t": np.zeros(4, np.float32)}, str(tmp_path / "t.safetensors"))
    sid = upload("acc.safetensors", (tmp_path / "t.safetensors").read_bytes())
    api.load(fid).close()
    api.gather(fid, dim=4, start=0, count=1).close()
    for b in api.load_batch([fid, fid]):
        b.close()
    api.load_safetensors([sid]).close()
    api.prefetch([fid, sid], target="page_cache", wait=True, progress=False)

    def count(i: int) -> int:
        return int(api.file(i)["access_count"])

    import time

    deadline = time.monotonic() + 5
    while (count(fid), count(sid)) != (5, 2) and time.monotonic() < deadline:
        time.sleep(0.05)  # accesses are flushed in batches
    assert (count(fid), count(sid)) == (5, 2)


def test_stats_per_path_and_tier_and_reset(api, upload):
    fid = upload("s.bin", b"\2" * 100_000, tier="ssd")
    api.load(fid).close()
    s = api.stats()
    assert s["bytes_transferred"] >= 100_000
    assert s["by_tier"]["ssd"]["operations_completed"] >= 1
    assert s["by_path"]["host"]["bytes_transferred"] >= 100_000
    after = api.request("POST", "/v1/stats/reset")
    assert after["bytes_transferred"] == 0 and after["by_tier"] == {}


def test_buffer_from_info_in_another_client(api, upload, server):
    """A lease can be opened by a second client (e.g. a worker) by its id."""
    fid = upload("o.bin", b"abc" * 1000)
    first = api.load(fid, release_on_close=False)
    first.close()
    with Client(server.url) as other, other.open_buffer(first.id) as b:
        assert isinstance(b, Buffer)
        assert np.asarray(b).tobytes() == b"abc" * 1000
    assert leased(api) == 0
