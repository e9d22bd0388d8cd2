"""Bad input gets the right status and a clear message, and leaks nothing: leased bytes and
shared-memory segments are back to zero after every error path."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from tests.serving.conftest import MiB, shm_segments


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tests.conftest import make_settings

    root = tmp_path_factory.mktemp("bad")
    settings = make_settings(
        root / "data",
        watch=False,
        buffers={"cpu_budget_bytes": 8 * MiB, "max_gather_indices": 100, "max_batch_items": 4},
    )
    before = shm_segments()
    with TestClient(create_app(settings), base_url="http://127.0.0.1") as c:
        ids = {}
        for name, data in {
            "m.bin": np.arange(64 * 8, dtype=np.float32).tobytes(),  # 64 rows x 8
            "odd.bin": b"x" * 1001,
            "big.bin": b"\0" * (6 * MiB),
            "bad.safetensors": struct.pack("<Q", 5) + b"{nope",
            "ok.safetensors": _safetensors({"w": np.ones(4, np.float32)}),
        }.items():
            r = c.put("/v1/files/content", params={"path": name}, content=data)
            ids[name] = r.json()["id"]
        yield {"client": c, "ids": ids}
    assert shm_segments() - before == set()


def _safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    header: dict[str, Any] = {}
    data = b""
    for k, v in tensors.items():
        header[k] = {
            "dtype": "F32",
            "shape": list(v.shape),
            "data_offsets": [len(data), len(data) + v.nbytes],
        }
        data += v.tobytes()
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def _f(env: dict[str, Any], name: str) -> int:
    return int(env["ids"][name])


CASES = [
    # (name, route, body builder, status, code)
    ("unknown id", "/v1/load", lambda e: {"file_id": 999999}, 404, "file_not_found"),
    ("unknown path", "/v1/load", lambda e: {"path": "no/such"}, 404, "file_not_found"),
    ("bad path", "/v1/load", lambda e: {"path": "../etc/passwd"}, 422, "invalid_path"),
    ("both refs", "/v1/load", lambda e: {"file_id": 1, "path": "m.bin"}, 422, "invalid_request"),
    (
        "range past end",
        "/v1/load",
        lambda e: {"file_id": _f(e, "odd.bin"), "offset": 1000, "length": 2},
        416,
        "invalid_range",
    ),
    (
        "offset past end",
        "/v1/load",
        lambda e: {"file_id": _f(e, "odd.bin"), "offset": 5000},
        416,
        "invalid_range",
    ),
    (
        "no such gpu",
        "/v1/load",
        lambda e: {"file_id": _f(e, "odd.bin"), "device": "cuda:99"},
        422,
        "invalid_device",
    ),
    (
        "not a device",
        "/v1/load",
        lambda e: {"file_id": _f(e, "odd.bin"), "device": "tpu"},
        422,
        "invalid_device",
    ),
    (
        "dtype does not divide",
        "/v1/load",
        lambda e: {"file_id": _f(e, "odd.bin"), "dtype": "float32"},
        422,
        "invalid_dtype",
    ),
    (
        "not a dtype",
        "/v1/load",
        lambda e: {"file_id": _f(e, "odd.bin"), "dtype": "object"},
        422,
        "invalid_dtype",
    ),
    (
        "a comma, which NumPy parses as a field list with ast (the fuzzer's SyntaxError)",
        "/v1/load",
        lambda e: {"file_id": _f(e, "odd.bin"), "dtype": ","},
        422,
        "invalid_dtype",
    ),
    (
        "shape mismatch",
        "/v1/load",
        lambda e: {"file_id": _f(e, "m.bin"), "dtype": "float32", "shape": [3, 3]},
        422,
        "invalid_input",
    ),
    (
        "ttl too long",
        "/v1/load",
        lambda e: {"file_id": _f(e, "m.bin"), "ttl_s": 1e9},
        422,
        "invalid_input",
    ),
    (
        "over budget",
        "/v1/load/batch",
        lambda e: {"items": [{"file_id": _f(e, "big.bin")}, {"file_id": _f(e, "big.bin")}]},
        507,
        "insufficient_space",
    ),
    (
        "batch with one bad item",
        "/v1/load/batch",
        lambda e: {"items": [{"file_id": _f(e, "m.bin")}, {"file_id": 999999}]},
        404,
        "file_not_found",
    ),
    (
        "batch too long",
        "/v1/load/batch",
        lambda e: {"items": [{"file_id": _f(e, "m.bin")}] * 5},
        413,
        "too_large",
    ),
    (
        "too many indices",
        "/v1/vectors/gather",
        lambda e: {"file_id": _f(e, "m.bin"), "dim": 8, "indices": list(range(101))},
        413,
        "too_large",
    ),
    (
        "index outside matrix",
        "/v1/vectors/gather",
        lambda e: {"file_id": _f(e, "m.bin"), "dim": 8, "indices": [0, 64]},
        422,
        "index_out_of_range",
    ),
    (
        "negative index",
        "/v1/vectors/gather",
        lambda e: {"file_id": _f(e, "m.bin"), "dim": 8, "indices": [-1]},
        422,
        "index_out_of_range",
    ),
    (
        "rows outside matrix",
        "/v1/vectors/gather",
        lambda e: {"file_id": _f(e, "m.bin"), "dim": 8, "start": 60, "count": 5},
        422,
        "index_out_of_range",
    ),
    (
        "dim does not divide",
        "/v1/vectors/gather",
        lambda e: {"file_id": _f(e, "odd.bin"), "dim": 3, "dtype": "uint8", "start": 0, "count": 1},
        422,
        "invalid_dtype",
    ),
    (
        "indices and start",
        "/v1/vectors/gather",
        lambda e: {"file_id": _f(e, "m.bin"), "dim": 8, "indices": [1], "start": 0, "count": 1},
        422,
        "invalid_input",
    ),
    (
        "malformed safetensors",
        "/v1/load/safetensors",
        lambda e: {"file_ids": [_f(e, "ok.safetensors"), _f(e, "bad.safetensors")]},
        422,
        "malformed_file",
    ),
    (
        "unknown tensor",
        "/v1/load/safetensors",
        lambda e: {"file_ids": [_f(e, "ok.safetensors")], "names": ["w", "nope"]},
        422,
        "invalid_input",
    ),
    (
        "duplicate tensor in shards",
        "/v1/load/safetensors",
        lambda e: {"file_ids": [_f(e, "ok.safetensors"), _f(e, "ok.safetensors")]},
        422,
        "invalid_input",
    ),
    (
        "prefetch unknown file",
        "/v1/prefetch",
        lambda e: {"file_ids": [_f(e, "m.bin"), 999999], "target": "page_cache"},
        404,
        "file_not_found",
    ),
    (
        "prefetch bad target",
        "/v1/prefetch",
        lambda e: {"file_ids": [_f(e, "m.bin")], "target": "tape"},
        422,
        "invalid_request",
    ),
]


@pytest.mark.parametrize(
    ("route", "build", "status", "code"),
    [pytest.param(*c[1:], id=c[0]) for c in CASES],
)
def test_bad_input(env, route, build, status, code):
    c = env["client"]
    r = c.post(route, json=build(env))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"]
    # Nothing is left behind by the failed request.
    buffers = c.get("/v1/buffers").json()
    assert buffers["items"] == []
    assert sum(buffers["leased_bytes"].values()) == 0
    assert not shm_segments()


def test_over_budget_says_what_is_free(env):
    c = env["client"]
    big = _f(env, "big.bin")
    first = c.post("/v1/load", json={"file_id": big})
    assert first.status_code == 200
    r = c.post("/v1/load", json={"file_id": big})
    assert r.status_code == 507
    err = r.json()["error"]
    assert err["free"] == 8 * MiB - first.json()["alloc_bytes"]
    assert err["budget"] == 8 * MiB and err["requested"] == 6 * MiB
    assert str(err["free"]) in err["message"]
    c.delete(f"/v1/buffers/{first.json()['buffer_id']}")
    assert c.get("/v1/buffers").json()["leased_bytes"]["cpu"] == 0


def test_unknown_buffer_and_job(env):
    c = env["client"]
    for method, path in [
        ("POST", "/v1/buffers/nope/renew"),
        ("DELETE", "/v1/buffers/nope"),
        ("GET", "/v1/buffers/nope"),
        ("GET", "/v1/jobs/nope"),
        ("DELETE", "/v1/jobs/nope"),
    ]:
        r = c.request(method, path)
        assert r.status_code == 404, (method, path)
        # Each kind of thing names itself: a job is not a buffer.
        want = "job_not_found" if "/jobs/" in path else "buffer_not_found"
        assert r.json()["error"]["code"] == want, (method, path)
