"""Damage found in a compressed file is handled as damage (RELIABILITY.md row 30): no clean 200
for a full read, no traceback, the file quarantined once with the reason, scans report it
skipped (never ``changed``) and do not hash it again, ``/readyz`` and ``/metrics`` show it."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveServer, make_settings
from tests.helpers import engine_settings, put, tier_files
from tierd_bench.codec import synthetic_bf16
from tiering.codec import CHUNK, open_bytes
from tiering.engine import Engine
from tiering.errors import IntegrityError
from tiering.sync import reconcile_paths
from tiering.tiers.paths import COMPRESSED_DIR

PATH = "llm/model.safetensors"


@pytest.fixture(scope="module")
def bf16() -> bytes:
    return synthetic_bf16(2 * CHUNK + (1 << 20), tensors=3)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def logged() -> Iterator[list[logging.LogRecord]]:
    """Every record of the server's loggers (uvicorn's do not reach the root's handlers)."""
    h = _Records()
    loggers = [logging.getLogger(n) for n in ("", "uvicorn.error", "uvicorn.access")]
    for lg in loggers:
        lg.addHandler(h)
    yield h.records
    for lg in loggers:
        lg.removeHandler(h)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    # The embedded default: hdd compresses ("auto").
    with LiveServer(make_settings(tmp_path / "data", watch=False)) as srv:
        yield srv


def _damage_chunk(stored: Path, i: int) -> None:
    """One bit of chunk ``i`` flipped, as the disk would: the size and mtime stay."""
    st = stored.stat()
    disk = bytearray(stored.read_bytes())
    e = open_bytes(bytes(disk)).index[i]
    disk[e.offset + e.length // 2] ^= 0x10
    stored.write_bytes(bytes(disk))
    os.utime(stored, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_damaged_chunk_cuts_the_read_and_quarantines_once(
    server: LiveServer, bf16: bytes, logged: list[logging.LogRecord]
) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.put("/v1/files/content", params={"path": PATH, "tier": "hdd"}, content=bf16)
        assert r.status_code == 201, r.text
        fid = r.json()["id"]
        _damage_chunk(server.settings.data_dir / "hdd" / COMPRESSED_DIR / PATH, 1)
        # Chunk 0 is sound: a range inside it is served.
        r = http.get(f"/v1/files/{fid}/content", headers={"Range": "bytes=0-99"})
        assert r.status_code == 206 and r.content == bf16[:100]
        # A full read: the status line went out with chunk 0; the connection is cut at chunk 1.
        for _ in range(2):
            with pytest.raises(httpx.RemoteProtocolError):
                http.get(f"/v1/files/{fid}/content")
        rec = http.get(f"/v1/files/{fid}").json()
        assert rec["state"] == "quarantined"
        assert rec["detail"].startswith("damaged: ") and "chunk 1" in rec["detail"], rec
        # Scans say skipped, with the reason; never changed; the file is not hashed again.
        for _ in range(2):
            scan = http.post("/v1/scan").json()
            assert PATH in scan["skipped"] and PATH not in scan["changed"], scan
            assert scan["reasons"][PATH].startswith("damaged: ")
        ready = http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "degraded"
        integrity = ready.json()["checks"]["integrity"]
        assert integrity["ok"] is False and integrity["failures"] == 1
        assert [d["path"] for d in integrity["damaged"]] == [PATH]
        metrics = http.get("/metrics").text
        assert re.search(r"^tierd_integrity_failures_total 1\.0$", metrics, re.M), metrics
        assert re.search(r"^tierd_damaged_files 1\.0$", metrics, re.M)
        # Uploaded again, the file is sound and readiness is back.
        r = http.put("/v1/files/content", params={"path": PATH, "overwrite": "true"}, content=bf16)
        assert r.status_code in (200, 201), r.text
        assert http.get(f"/v1/files/{r.json()['id']}/content").content == bf16
        assert http.get("/readyz").json()["status"] == "ready"
    warnings = [r for r in logged if "damaged" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    # No traceback anywhere, and not Starlette's "response already started" either.
    assert not [r.getMessage() for r in logged if r.exc_info], "a traceback was logged"
    assert not [r for r in logged if "already started" in r.getMessage()]
    assert not [r for r in logged if "without completing response" in r.getMessage()]


def test_a_truncated_container_in_a_tier_root_is_skipped_not_retried(
    server: LiveServer, bf16: bytes, logged: list[logging.LogRecord]
) -> None:
    hdd = server.settings.data_dir / "hdd"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.put("/v1/files/content", params={"path": PATH, "tier": "hdd"}, content=bf16)
        stored = (hdd / COMPRESSED_DIR / PATH).read_bytes()
        cut = hdd / COMPRESSED_DIR / "cut/model.safetensors"
        cut.parent.mkdir(parents=True)
        cut.write_bytes(stored[: len(stored) // 2])
        for _ in range(3):
            scan = http.post("/v1/scan").json()
            assert scan["skipped"] == ["cut/model.safetensors"] and not scan["adopted"], scan
            assert "footer" in scan["reasons"]["cut/model.safetensors"]
        assert (
            http.get("/v1/files/lookup", params={"path": "cut/model.safetensors"}).status_code
            == 404
        )
        assert http.get("/readyz").json()["checks"]["integrity"]["damaged"][0]["file_id"] is None
        cut.unlink()
        assert http.post("/v1/scan").json()["skipped"] == []
        assert http.get("/readyz").json()["status"] == "ready"
    warnings = [r for r in logged if "damaged" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert not [r for r in logged if r.exc_info]


def test_the_watchers_reconcile_of_a_damaged_container_is_one_finding(
    tmp_path: Path, bf16: bytes
) -> None:
    """The watcher reconciles the relpaths its events name: a truncated container there is
    skipped with the reason and found once, however often it is asked (it used to log a
    traceback twice a second forever)."""
    settings = engine_settings(tmp_path / "data", compression="on")
    with Engine(settings.engine_config()) as eng:
        rec = put(eng, PATH, bf16, tier="hdd")
        stored = settings.data_dir / "hdd" / COMPRESSED_DIR / PATH
        stored.write_bytes(stored.read_bytes()[:-100])
        for _ in range(3):
            report = reconcile_paths(eng.catalog, eng.tiers, [PATH], damage=eng.damage)
            assert report.skipped == [PATH] and not report.changed
            assert "footer" in report.reasons[PATH]
        assert eng.damage.failures == 1
        assert eng.get(rec.id).state == "quarantined"


def test_a_move_of_a_damaged_file_quarantines_it_as_damaged(tmp_path: Path, bf16: bytes) -> None:
    settings = engine_settings(tmp_path / "data", compression="on")
    with Engine(settings.engine_config()) as eng:
        rec = put(eng, PATH, bf16, tier="hdd")
        _damage_chunk(settings.data_dir / "hdd" / COMPRESSED_DIR / PATH, 1)
        with pytest.raises(IntegrityError, match="damaged: .*chunk 1"):
            eng.migrate(rec.id, "nvme")
        after = eng.get(rec.id)
        assert (after.state, after.tier) == ("quarantined", "hdd")
        assert after.detail is not None and after.detail.startswith("damaged: ")
        assert not (settings.data_dir / "nvme" / PATH).exists()
        assert "<temp>" not in tier_files(eng)


def test_metrics_carry_the_process_and_the_integrity_counter(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url) as http:
        text = http.get("/metrics").text
    for name in (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
        "python_info",
        "tierd_integrity_failures_total",
    ):
        assert re.search(rf"^{name}[ {{]", text, re.M), name
