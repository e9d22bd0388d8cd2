"""``wait: false`` loads into a GPU from the memory tier: the server replies once its copies
are queued, each buffer's handle names the interprocess CUDA event they land by
(``ready_event``), and a client in a second process that waits on it reads exactly the file.
Without ``wait: false`` nothing changes: the reply comes after the copies, with no event.

The server runs in this process and the client in a child (a process cannot open its own CUDA
IPC handles)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import LiveServer, wait_for
from tests.models.torch_support import run_child
from tests.placement.memory_support import MiB, memory_settings
from tierd_client import Client

pytestmark = pytest.mark.gpu

# Big enough that the copies (about 10 ms at the link's rate) are still running when the reply
# is built (well under a millisecond after they are queued), so the event is in it.
_TENSOR = 128 * MiB
_SHARDS = 4


def _write_safetensors(path: Path, arrays: dict[str, np.ndarray]) -> None:
    header: dict[str, object] = {}
    at = 0
    for name, a in arrays.items():
        header[name] = {"dtype": "U8", "shape": [a.size], "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    body = b"".join(a.tobytes() for a in arrays.values())
    path.write_bytes(struct.pack("<Q", len(head)) + head + body)


@pytest.fixture
def shards(tmp_path: Path) -> list[str]:
    root = tmp_path / "data"
    rng = np.random.default_rng(7)
    paths = []
    for i in range(_SHARDS):
        rel = f"m/shard-{i}.safetensors"
        dst = root / "nvme" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        arrays = {f"w{i}.{j}": rng.integers(0, 255, _TENSOR // 2, np.uint8) for j in range(2)}
        _write_safetensors(dst, arrays)
        paths.append(rel)
    return paths


@pytest.fixture
def server(tmp_path: Path, shards: list[str]) -> Iterator[LiveServer]:
    settings = memory_settings(
        tmp_path / "data",
        quota=2048 * MiB,
        buffers={"gpu_budget_bytes": 4096 * MiB, "reap_interval_s": 0.05},
    )
    with LiveServer(settings) as srv:
        with Client(srv.url) as api:
            wait_for(lambda: {f["path"] for f in api.files()} >= set(shards), what="the scan")
            api.prefetch(shards, target="memory", wait=True, progress=False, timeout=120)
        with httpx.Client(base_url=srv.url) as http:
            assert http.post("/v1/stats/reset").status_code == 200
        yield srv


CHILD = """
import json, sys
import numpy as np
import httpx
from tierd_client import Client
from tiering.io.buffers import attach
from tiering.io.fences import wait_ready
from tiering.io.safetensors import read_header

args = json.loads(sys.argv[1])
files = {p: open(f, "rb").read() for p, f in zip(args["paths"], args["files"])}
with httpx.Client(base_url=args["url"], timeout=60) as http:
    for wait in (False, True, False):
        body = {"paths": args["paths"], "device": "cuda:0", "wait": wait}
        r = http.post("/v1/load/safetensors", json=body)
        assert r.status_code == 200, r.text
        reply = r.json()
        events = {json.dumps(b["handle"].get("ready_event")) for b in reply["buffers"]}
        sources = {b["source"] for b in reply["buffers"]}
        assert sources == {"memory"}, sources
        if wait:
            assert events == {"null"}, events  # landed at the reply
            assert all(b["seconds"] is not None for b in reply["buffers"])
        else:
            # One event for the load's copies, still running when the reply was made.
            assert len(events) == 1 and "null" not in events, events
            assert all(b["seconds"] is None for b in reply["buffers"])
        opened = {b["buffer_id"]: attach(b["handle"], b["nbytes"]) for b in reply["buffers"]}
        wait_ready(b["handle"] for b in reply["buffers"])
        for path in args["paths"]:
            data = files[path]
            for name, t in read_header(args["files"][args["paths"].index(path)]).tensors.items():
                loc = reply["tensors"][name]
                arr = opened[loc["buffer_id"]].array[loc["offset"] : loc["offset"] + loc["nbytes"]]
                got = arr.get().tobytes()
                assert got == data[t.begin : t.end], name
        for a in opened.values():
            a.close()
        for b in reply["buffers"]:
            assert http.delete(f"/v1/buffers/{b['buffer_id']}").status_code == 200
with Client(args["url"]) as api:
    sd = api.load_state_dict(args["paths"], device="cuda:0")
    for path, f in zip(args["paths"], args["files"]):
        data = files[path]
        for name, t in read_header(f).tensors.items():
            got = sd[name].cpu().numpy().tobytes()
            assert got == data[t.begin : t.end], name
    del sd
print("child ok")
"""


def test_a_no_wait_load_hands_out_the_event_its_copies_land_by(
    server: LiveServer, shards: list[str], tmp_path: Path
) -> None:
    files = [str(tmp_path / "data" / "nvme" / p) for p in shards]
    run_child(CHILD, {"url": server.url, "paths": shards, "files": files})
    total = _SHARDS * _TENSOR
    with httpx.Client(base_url=server.url) as http:
        wait_for(lambda: not http.get("/v1/buffers").json()["items"], what="leases released")

        # Four loads' copies, the deferred ones counted by their fence once they landed.
        def copied() -> bool:
            copy = http.get("/v1/stats").json()["by_path"]["copy"]
            assert copy["operations_failed"] == 0
            return bool(copy["bytes_transferred"] == 4 * total)

        wait_for(copied, what="every copy counted")
