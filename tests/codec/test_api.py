"""A compressed tier through the real service: every load path reads the logical bytes, and
the API and metrics show the stored size, the codec and the bytes saved."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import LiveServer, make_settings
from tierd_bench.codec import synthetic_bf16
from tierd_client import Client
from tiering.codec import CHUNK, CODEC, MAGIC
from tiering.tiers.paths import COMPRESSED_DIR

MiB = 1 << 20


@pytest.fixture(scope="module")
def bf16() -> bytes:
    return synthetic_bf16(CHUNK + 3 * MiB, tensors=3)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    # The embedded default: nvme, ssd, hdd; compression "auto" is on for hdd only.
    settings = make_settings(tmp_path / "data", buffers={"cpu_budget_bytes": 64 * MiB})
    with LiveServer(settings) as srv:
        yield srv


def test_compressed_file_over_rest(server: LiveServer, bf16: bytes) -> None:
    path = "llm/model.safetensors"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.put("/v1/files/content", params={"path": path, "tier": "hdd"}, content=bf16)
        assert r.status_code == 201, r.text
        rec = r.json()
        assert (rec["size"], rec["codec"]) == (len(bf16), CODEC)
        assert rec["stored_size"] <= 0.72 * len(bf16)
        disk = (server.settings.data_dir / "hdd" / COMPRESSED_DIR / path).read_bytes()
        assert disk.startswith(MAGIC) and len(disk) == rec["stored_size"]
        assert http.get(f"/v1/files/{rec['id']}").json()["stored_size"] == rec["stored_size"]

        hdd = next(t for t in http.get("/v1/tiers").json() if t["name"] == "hdd")
        assert (hdd["file_bytes"], hdd["stored_bytes"]) == (len(bf16), rec["stored_size"])

        r = http.get(f"/v1/files/{rec['id']}/content", headers={"Range": "bytes=10-8388700"})
        assert r.status_code == 206 and r.content == bf16[10:8388701]
        assert http.get(f"/v1/files/{rec['id']}/content").content == bf16
        metrics = http.get("/metrics").text
    saved = re.search(r'tierd_compression_saved_bytes\{tier="hdd"\} (\S+)', metrics)
    assert saved is not None and float(saved.group(1)) == len(bf16) - rec["stored_size"]

    with Client(server.url) as api:
        with api.load(path) as b:
            assert np.asarray(b).tobytes() == bf16
        with api.load(rec["id"], offset=CHUNK - 3, length=11) as b:
            assert np.asarray(b).tobytes() == bf16[CHUNK - 3 : CHUNK + 8]
        with api.load_safetensors(path) as t:
            assert np.asarray(t["layers.1.weight"]).tobytes() == _tensor(bf16, "layers.1.weight")

    # Promoted to nvme: decompressed, the codec gone from the record.
    with httpx.Client(base_url=server.url, timeout=60) as http:
        move = {"file_id": rec["id"], "to_tier": "nvme"}
        r = http.post("/v1/migrations", json=move, params={"wait": True})
        assert r.status_code == 200, r.text
        after = http.get(f"/v1/files/{rec['id']}").json()
    assert (after["tier"], after["codec"], after["stored_size"]) == ("nvme", None, len(bf16))
    assert (server.settings.data_dir / "nvme" / path).read_bytes() == bf16


def _tensor(data: bytes, name: str) -> bytes:
    n = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + n])[name]["data_offsets"]
    return data[8 + n + begin : 8 + n + end]


def test_page_cache_prefetch_warms_a_compressed_files_container(
    server: LiveServer, bf16: bytes
) -> None:
    """It used to fail on every compressed file (no local file to read): the container is
    what a compressed file's reads go through the page cache for."""
    path = "llm/warm.safetensors"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.put("/v1/files/content", params={"path": path, "tier": "hdd"}, content=bf16)
        assert r.status_code == 201 and r.json()["codec"] == CODEC, r.text
        with Client(server.url) as api:
            job = api.prefetch([r.json()["id"]], target="page_cache", wait=True, progress=False)
    assert job["state"] == "done" and not job.get("errors"), job
    assert job["files_done"] == 1 and 0 < job["bytes_done"] <= len(bf16)
