"""GPU resident copies outlive their last lease: a later shared load is handed the same
allocation (source ``gpu``, nothing read), a plain one copies device -> device; kept copies
stay within ``gpu_resident_bytes``, least recently used out first, go the moment a lease needs
the room and when their file changes; ``gpu_resident_bytes=0`` keeps nothing. Over REST, a
second process started after the first exited is handed the first one's copy.

In-process loaders over a real engine, and a real server for the restart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import LiveServer, make_settings, wait_for
from tests.helpers import engine_settings, put
from tiering.engine import Engine
from tiering.io import Device
from tiering.io.buffers import alloc_size
from tiering.serving import Loader, LoaderConfig

pytestmark = pytest.mark.gpu

MiB = 1 << 20
GPU = Device("cuda:0")


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    pytest.importorskip("cupy")
    with Engine(engine_settings(tmp_path / "d").engine_config()) as eng:
        yield eng


def _bytes(lease) -> bytes:  # type: ignore[no-untyped-def]
    import cupy

    return bytes(cupy.asnumpy(lease.buffer.array()[lease.offset : lease.offset + lease.nbytes]))


def _kept(ld: Loader) -> set[int]:
    return {e.key.file_id for e in ld.residency.entries()}


def test_a_kept_copy_is_shared_and_copied_after_its_last_lease(engine: Engine) -> None:
    data = os.urandom(8 * MiB + 5)
    rec = put(engine, "a.bin", data)
    ld = Loader(engine, LoaderConfig(gpu_budget_bytes=256 * MiB)).start()
    try:
        first = ld.load(rec.id, device="cuda:0", shared=True)
        ptr = first.buffer.array().data.ptr
        ld.leases.release(first.id)
        # The allocation's own size: the loader allocates whole read chunks (10 MiB here).
        kept = first.buffer.alloc_bytes
        assert kept >= alloc_size(GPU, len(data))
        assert ld.leases.kept_bytes() == {"cuda:0": kept}
        assert ld.leases.leased_bytes() == {"cuda:0": 0}
        again = ld.load(rec.id, device="cuda:0", shared=True)
        assert again.reused and again.buffer.array().data.ptr == ptr
        assert again.report is not None and again.report.source == "gpu"
        assert again.report.nbytes == 0 and _bytes(again) == data
        ld.leases.release(again.id)
        own = ld.load(rec.id, device="cuda:0")  # copied device -> device from the kept copy
        assert own.report is not None and own.report.source == "gpu"
        assert own.report.io_path == "copy" and own.buffer.array().data.ptr != ptr
        assert _bytes(own) == data
        ld.leases.release(own.id)
        host = ld.load(rec.id, device="cpu")  # device -> host
        assert host.report is not None and host.report.source == "gpu" and _bytes_cpu(host) == data
        ld.leases.release(host.id)
    finally:
        ld.stop()


def _bytes_cpu(lease) -> bytes:  # type: ignore[no-untyped-def]
    return bytes(lease.buffer.array()[lease.offset : lease.offset + lease.nbytes])


def test_least_recently_used_out_and_room_on_need(engine: Engine) -> None:
    size = 16 * MiB
    a, b, c = (put(engine, f"{n}.bin", os.urandom(size)) for n in "abc")
    big = put(engine, "big.bin", os.urandom(2 * size))
    cfg = LoaderConfig(gpu_budget_bytes=4 * size, gpu_resident_bytes=2 * size)
    ld = Loader(engine, cfg).start()
    try:
        for rec in (a, b, a, c):  # a used again after b: b is the least recently used
            ld.leases.release(ld.load(rec.id, device="cuda:0", shared=True).id)
        assert _kept(ld) == {a.id, c.id}
        # 2 kept + 2 needed fit the budget of 4; 1 more kept copy would not: the oldest goes.
        ld.leases.release(ld.load(b.id, device="cuda:0", shared=True).id)
        assert _kept(ld) == {c.id, b.id}
        one = ld.load(big.id, device="cuda:0")
        assert _kept(ld) == {c.id, b.id}
        extra = ld.load(a.id, device="cuda:0")  # 2 + 2 + 1 > 4: c, the older, goes
        assert _kept(ld) == {b.id}
        assert ld.leases.leased_bytes() == {"cuda:0": 3 * size}
        for lease in (one, extra):
            ld.leases.release(lease.id)
    finally:
        ld.stop()


def test_no_keeping_with_a_zero_budget(engine: Engine) -> None:
    rec = put(engine, "z.bin", os.urandom(4 * MiB))
    ld = Loader(engine, LoaderConfig(gpu_budget_bytes=64 * MiB, gpu_resident_bytes=0)).start()
    try:
        ld.leases.release(ld.load(rec.id, device="cuda:0", shared=True).id)
        assert _kept(ld) == set() and ld.leases.kept_bytes() == {}
        after = ld.load(rec.id, device="cuda:0")
        assert after.report is not None and after.report.io_path != "copy"
        ld.leases.release(after.id)
    finally:
        ld.stop()


def test_a_rewritten_file_drops_its_kept_copy(engine: Engine) -> None:
    rec = put(engine, "w.bin", os.urandom(4 * MiB))
    ld = Loader(engine, LoaderConfig(gpu_budget_bytes=64 * MiB, reap_interval_s=0.05)).start()
    try:
        ld.leases.release(ld.load(rec.id, device="cuda:0", shared=True).id)
        assert _kept(ld) == {rec.id}
        new = os.urandom(4 * MiB)
        with engine.begin_upload("w.bin", overwrite=True) as up:
            up.write(new)
            up.commit()
        wait_for(lambda: _kept(ld) == set(), what="the sweep to drop the stale copy")
        assert ld.leases.kept_bytes() == {"cuda:0": 0}
        fresh = ld.load("w.bin", device="cuda:0", shared=True)
        assert not fresh.reused and _bytes(fresh) == new
        ld.leases.release(fresh.id)
    finally:
        ld.stop()


def test_kept_copies_go_when_the_gpu_itself_is_full(engine: Engine) -> None:
    """Other processes' memory leaves no room for an allocation inside the budget: the
    failed cudaMalloc lets the kept copies go, and the load goes on."""
    import cupy

    size = 256 * MiB
    a = put(engine, "a.bin", os.urandom(size))
    data = os.urandom(size)
    b = put(engine, "b.bin", data)
    _free, total = cupy.cuda.runtime.memGetInfo()
    ld = Loader(engine, LoaderConfig(gpu_budget_bytes=total)).start()  # the budget never binds
    hog: list[Any] = []
    try:
        ld.leases.release(ld.load(a.id, device="cuda:0", shared=True).id)
        assert _kept(ld) == {a.id}
        chunk = 1 << 30
        while chunk >= 16 * MiB:  # as another process would: take nearly all that is free
            try:
                hog.append(cupy.cuda.Memory(chunk))
            except Exception:
                chunk //= 2
        # About 128 MiB free: slack for the CUDA runtime, and less than one file.
        while hog and cupy.cuda.runtime.memGetInfo()[0] < 128 * MiB:
            hog.pop()
        extra = (cupy.cuda.runtime.memGetInfo()[0] - 128 * MiB) // (2 * MiB) * (2 * MiB)
        if extra > 0:
            hog.append(cupy.cuda.Memory(extra))
        assert cupy.cuda.runtime.memGetInfo()[0] < size
        lease = ld.load(b.id, device="cuda:0")
        assert _kept(ld) == set() and _bytes(lease) == data
        ld.leases.release(lease.id)
    finally:
        hog.clear()
        ld.stop()


CHILD = textwrap.dedent(
    """
    import json, sys
    import cupy as cp
    from tierd_client import Client

    args = json.loads(sys.argv[1])
    with Client(args["url"]) as api, api.load(args["id"], device="cuda:0", shared=True) as b:
        print(json.dumps({
            "ipc": b.info["handle"]["ipc_handle"], "reused": b.reused, "source": b.source,
            "same": cp.asnumpy(b.array).tobytes() == open(args["file"], "rb").read(),
        }))
    """
)


def test_a_restarted_process_is_handed_the_first_ones_copy(data_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("cupy")
    settings = make_settings(data_dir, watch=False, buffers={"gpu_budget_bytes": 256 * MiB})
    data = os.urandom(32 * MiB + 3)
    local = tmp_path / "m.bin"
    local.write_bytes(data)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
    }
    with LiveServer(settings) as srv, srv.client() as http:
        r = http.put("/v1/files/content", params={"path": "m.bin"}, content=data)
        assert r.status_code == 201, r.text
        args = json.dumps({"url": srv.url, "id": r.json()["id"], "file": str(local)})
        seen = []
        for _ in range(2):  # one process after the other: the first has exited
            done = subprocess.run(
                [sys.executable, "-c", CHILD, args],
                capture_output=True, text=True, timeout=300, env=env,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            seen.append(json.loads(done.stdout.strip().splitlines()[-1]))
        first, second = seen
        assert first["same"] and not first["reused"] and first["source"] != "gpu"
        assert second == {"ipc": first["ipc"], "reused": True, "source": "gpu", "same": True}
        view = http.get("/v1/buffers").json()
        assert view["items"] == [] and view["resident_copies"] == {"cuda:0": 1}
        # Kept: all of the resident bytes, an allocation of at least the file's size (the
        # loader allocates whole read chunks).
        assert view["kept_bytes"] == view["resident_bytes"]
        assert view["kept_bytes"]["cuda:0"] >= alloc_size(GPU, len(data))
