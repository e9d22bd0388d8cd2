"""Models over REST, on a real uvicorn server with real tiers and catalog: list, show, load
into ``cpu`` (bytes checked against ``safetensors.numpy.load_file``), names and prefix,
prefetch with one job, pin and unpin; and every bad input, each proven to change nothing on
disk or in the catalog and to leave no lease behind. The client's model methods drive it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from app.cli import cli
from app.schemas_loads import SafetensorsOut
from tests.conftest import LiveServer, disk_snapshot, make_settings, wait_for
from tests.serving.conftest import shm_segments
from tierd_client import AuthError, Client, InvalidRequest, NotFound

ADMIN, DATA = "admin-secret", "data-secret"
S1, S2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
MiB = 1 << 20


def shard1() -> dict[str, np.ndarray]:
    return {
        "embed.weight": np.arange(48, dtype=np.float32).reshape(12, 4),
        "layers.0.w": np.linspace(-1, 1, 24, dtype=np.float16).reshape(4, 6),
        "layers.0.mask": np.array([True, False, True]),
    }


def shard2() -> dict[str, np.ndarray]:
    return {
        "layers.1.w": np.arange(30, dtype=np.int64).reshape(5, 6) - 7,
        "lm_head.weight": np.full((3, 4), 0.25, dtype=np.float64),
        "empty": np.zeros((0, 3), dtype=np.uint8),
    }


def index_of(*shards: tuple[str, dict[str, np.ndarray]]) -> bytes:
    wmap = {t: name for name, tensors in shards for t in tensors}
    return json.dumps({"metadata": {"total_size": 0}, "weight_map": wmap}).encode()


def write(root: Path, tier: str, relpath: str, data: bytes | dict[str, np.ndarray]) -> None:
    path = root / tier / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        save_file(data, str(path))


def llama(root: Path, name: str = "models/llama", index: bytes | None = None) -> None:
    """Two shards (the second on hdd), an index and a config."""
    write(root, "nvme", f"{name}/{S1}", shard1())
    write(root, "hdd", f"{name}/{S2}", shard2())
    write(root, "nvme", f"{name}/{INDEX}", index or index_of((S1, shard1()), (S2, shard2())))
    write(root, "nvme", f"{name}/config.json", b'{"model_type": "llama"}')


@contextmanager
def serve(root: Path) -> Iterator[tuple[Client, Client, LiveServer]]:
    """A real server over ``root``'s tiers (scanned at start): admin and data clients."""
    settings = make_settings(
        root,
        watch=False,
        admin_token=ADMIN,
        data_token=DATA,
        buffers={"cpu_budget_bytes": 64 * MiB, "reap_interval_s": 0.05},
    )
    before = shm_segments()
    with (
        LiveServer(settings) as srv,
        Client(srv.url, ADMIN) as admin,
        Client(srv.url, DATA) as data,
    ):
        yield admin, data, srv
        assert admin.buffers()["items"] == [], "a lease was left behind"
    assert shm_segments() - before == set()


def catalog(api: Client) -> list[tuple[Any, ...]]:
    """What a bad request must not change: each file's place, content and pin."""
    keys = ("path", "tier", "size", "checksum", "state", "pinned_tier", "generation")
    return sorted(tuple(f[k] for k in keys) for f in api.files())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "data"


def test_list_and_show(root: Path) -> None:
    llama(root)
    write(root, "ssd", "models/tiny/model.safetensors", {"w": np.ones(4, np.float32)})
    write(root, "ssd", "models/tiny/nested/model.safetensors", {"v": np.ones(2, np.int8)})
    write(root, "ssd", "models/tiny/nested/tokenizer.json", b"{}")
    write(root, "hdd", "data/table.bin", b"x" * 100)
    with serve(root) as (admin, data, _srv):
        models = data.models()
        assert [m["name"] for m in models] == ["models/llama", "models/tiny", "models/tiny/nested"]
        lm = models[0]
        sizes = {
            n: (root / t / "models/llama" / n).stat().st_size
            for t, n in [("nvme", S1), ("hdd", S2), ("nvme", INDEX), ("nvme", "config.json")]
        }
        assert lm["file_count"] == 4 and lm["total_bytes"] == sum(sizes.values())
        assert lm["weight_files"] == 2 and lm["weight_bytes"] == sizes[S1] + sizes[S2]
        assert lm["tiers"] == {"nvme": sizes[S1], "hdd": sizes[S2]}
        assert lm["has_index"] and lm["pinned_tier"] is None and lm["pinned_files"] == 0
        assert lm["heat_max"] == 0 and lm["heat_sum"] == 0
        # A model's files are those directly in its directory, not a nested model's.
        assert models[1]["file_count"] == 1 and not models[1]["has_index"]
        assert [m["name"] for m in data.models(prefix="models/tiny/")] == ["models/tiny/nested"]
        assert data.models(prefix="Models/") == []  # names are case-sensitive, like relpaths

        page = data.request("GET", "/v1/models", params={"limit": 2})
        assert [m["name"] for m in page["items"]] == ["models/llama", "models/tiny"]
        rest = data.request("GET", "/v1/models", params={"cursor": page["next_cursor"]})
        assert [m["name"] for m in rest["items"]] == ["models/tiny/nested"]
        assert rest["next_cursor"] is None

        shown = data.model("models/llama")
        assert [(f["name"], f["role"], f["tier"]) for f in shown["files"]] == [
            ("config.json", "other", "nvme"),
            (S1, "weights", "nvme"),
            (S2, "weights", "hdd"),
            (INDEX, "index", "nvme"),
        ]
        assert shown["layout"] == {"shards": [S1, S2], "index_file": INDEX, "tensors": 6}
        tiny = data.model("models/tiny")
        assert tiny["layout"] == {
            "shards": ["model.safetensors"],
            "index_file": None,
            "tensors": None,
        }
        for missing in ["models", "data", "models/none", "data/table.bin"]:
            with pytest.raises(NotFound) as exc:
                data.model(missing)
            assert exc.value.code == "model_not_found"


def test_load_all_into_cpu(root: Path) -> None:
    llama(root)
    expected = load_file(str(root / "nvme/models/llama" / S1)) | load_file(
        str(root / "hdd/models/llama" / S2)
    )
    with serve(root) as (admin, data, _srv):
        with data.load_model("models/llama") as tensors:
            assert set(tensors) == set(expected)
            for name, want in expected.items():
                got = np.asarray(tensors[name])
                assert got.dtype == want.dtype and got.shape == want.shape, name
                assert got.tobytes() == want.tobytes(), name
            assert len(tensors.buffers) == 2  # one lease per shard
            assert len(admin.buffers()["items"]) == 2
        assert admin.buffers()["items"] == []
        # The same reply as POST /v1/load/safetensors of the same shards.
        raw = data.request("POST", "/v1/models/load", params={"name": "models/llama"})
        same = data.request(
            "POST",
            "/v1/load/safetensors",
            json={"paths": [f"models/llama/{S1}", f"models/llama/{S2}"]},
        )
        assert set(raw) == set(same) == {"buffers", "tensors"}
        # The reply is built without pydantic (app.schemas_devices.safetensors_json): it is
        # the document its declared model would give, field for field.
        for reply in (raw, same):
            assert SafetensorsOut.model_validate(reply).model_dump(mode="json") == reply
        # wait=false asks for the reply before copies into a GPU land: into cpu there are
        # none, and the reply is the same, every read landed and timed, no event to wait on.
        eager = data.request(
            "POST", "/v1/models/load", params={"name": "models/llama"}, json={"wait": False}
        )
        assert [b["seconds"] is not None for b in eager["buffers"]] == [True, True]
        assert all("ready_event" not in b["handle"] for b in eager["buffers"])
        for b in eager["buffers"]:
            data.release(b["buffer_id"])
        strip = {"buffer_id"}
        assert [
            {k: v for k, v in t.items() if k not in strip} for t in raw["tensors"].values()
        ] == [{k: v for k, v in t.items() if k not in strip} for t in same["tensors"].values()]
        for b in raw["buffers"] + same["buffers"]:
            data.release(b["buffer_id"])

        # Every load counts one access of each shard it read (and of the index): heat.
        # Accesses reach the catalog in batches: wait for all of them, not the first.
        def counted() -> bool:
            m = data.models()[0]
            return bool(m["heat_max"] >= 2.9 and m["heat_sum"] >= 5.8)

        wait_for(counted, what="accesses counted")


def test_load_names_and_prefix(root: Path) -> None:
    llama(root)
    with serve(root) as (_admin, data, _srv):
        with data.load_model("models/llama", prefix="layers.") as t:
            assert sorted(t) == ["layers.0.mask", "layers.0.w", "layers.1.w"]
            assert np.asarray(t["layers.1.w"]).tolist() == (shard2()["layers.1.w"]).tolist()
        with data.load_model("models/llama", names=["lm_head.weight"]) as t:
            assert list(t) == ["lm_head.weight"] and len(t.buffers) == 1  # shard 1 not leased
            assert np.asarray(t["lm_head.weight"]).sum() == 3.0


def test_prefetch_is_one_job_over_the_whole_model(root: Path) -> None:
    llama(root)
    with serve(root) as (admin, data, _srv):
        total = data.models()[0]["total_bytes"]
        job = data.prefetch_model("models/llama", target="page_cache", wait=True, progress=False)
        assert job["state"] == "done" and job["files_total"] == job["files_done"] == 4
        assert job["bytes_total"] == job["bytes_done"] == total and job["progress"] == 1.0
        assert len([j for j in data.request("GET", "/v1/jobs") if j["id"] == job["id"]]) == 1
        # nvme: the model is promoted, every file of it, by one job.
        job = data.prefetch_model("models/llama", target="nvme", wait=True, progress=False)
        assert job["state"] == "done" and job["errors"] == []
        assert data.models()[0]["tiers"] == {"nvme": data.models()[0]["weight_bytes"]}
        assert {f["tier"] for f in data.model("models/llama")["files"]} == {"nvme"}
        assert (root / "nvme/models/llama" / S2).is_file()
        assert not (root / "hdd/models/llama" / S2).exists()


def test_pin_and_unpin(root: Path) -> None:
    llama(root)
    with serve(root) as (admin, data, _srv):
        before = catalog(admin)
        # The data token may not pin; nothing changes.
        with pytest.raises(AuthError) as exc:
            data.pin_model("models/llama")
        assert exc.value.status == 403
        with pytest.raises(AuthError):
            data.unpin_model("models/llama")
        with pytest.raises(NotFound):
            admin.pin_model("models/nope")
        with pytest.raises(NotFound) as missing:
            admin.pin_model("models/llama", tier="tape")
        assert missing.value.code == "tier_not_found"
        assert catalog(admin) == before
        # Default: the tier holding most weight bytes (shard 2, on hdd, is the larger). The
        # scheduler then brings the whole model there, pins ignoring the minimum age.
        pinned = admin.pin_model("models/llama")
        assert pinned["pinned_tier"] == "hdd" and pinned["pinned_files"] == 4
        assert {f["pinned_tier"] for f in pinned["files"]} == {"hdd"}

        def on(tier: str) -> bool:
            return {f["tier"] for f in data.model("models/llama")["files"]} == {tier}

        wait_for(lambda: on("hdd"), what="the pinned model on hdd")
        assert sorted(p.name for p in (root / "hdd/models/llama").iterdir()) == [
            "config.json",
            S1,
            S2,
            INDEX,
        ]
        assert admin.pin_model("models/llama", tier="ssd")["pinned_tier"] == "ssd"
        assert data.models()[0]["pinned_tier"] == "ssd"
        wait_for(lambda: on("ssd"), what="the pinned model on ssd")
        unpinned = admin.unpin_model("models/llama")
        assert unpinned["pinned_tier"] is None and unpinned["pinned_files"] == 0
        assert {f["pinned_tier"] for f in unpinned["files"]} == {None}


BAD_INDEXES = [
    pytest.param(
        index_of(
            (S1, shard1()), (S2, shard2()), ("model-00003-of-00003.safetensors", {"x": np.ones(1)})
        ),
        r"names 1 shard\(s\) that are not in the model: "
        r"model-00003-of-00003.safetensors \(1 tensor\)",
        id="missing-shard",
    ),
    pytest.param(b'{"weight_map": ', "is not UTF-8 JSON", id="malformed-json"),
    pytest.param(b'{"weight_map": [1]}', "weight_map must be an object", id="weight-map-list"),
    pytest.param(b'{"weight_map": {}}', "weight_map names no tensor", id="empty-weight-map"),
    pytest.param(
        f'{{"weight_map": {{"empty": "{S1}", "empty": "{S2}"}}}}'.encode(),
        f"tensor 'empty' is mapped twice, to '{S1}' and to '{S2}'",
        id="tensor-mapped-twice",
    ),
    pytest.param(
        json.dumps({"weight_map": {"embed.weight": "../secret.safetensors"}}).encode(),
        "is not a file name in the model's directory",
        id="shard-outside",
    ),
]


def _bad_request(data: Client, call: Any, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match) as exc:
        call()
    assert exc.value.status == 422 and exc.value.code == "invalid_model"


@pytest.mark.parametrize(("index", "match"), BAD_INDEXES)
def test_invalid_index_is_a_422_naming_it(root: Path, index: bytes, match: str) -> None:
    llama(root, index=index)
    with serve(root) as (admin, data, _srv):
        disk, before = disk_snapshot(root), catalog(admin)
        assert data.models()[0]["name"] == "models/llama"  # the list does not read indexes
        _bad_request(data, lambda: data.model("models/llama"), match)
        _bad_request(data, lambda: data.load_model("models/llama"), match)
        assert admin.buffers()["items"] == []
        assert disk_snapshot(root) == disk and catalog(admin) == before


@pytest.mark.parametrize(
    ("shards", "index", "match"),
    [
        pytest.param(
            {S1: shard1(), S2: shard2() | {"embed.weight": np.zeros(2, np.float32)}},
            None,
            f"tensor 'embed.weight' is in two shards: {S1} and {S2}",
            id="tensor-in-two-shards",
        ),
        pytest.param(
            {S1: shard1(), S2: shard2() | {"embed.weight": np.zeros(2, np.float32)}},
            index_of((S1, shard1()), (S2, shard2())),
            f"tensor 'embed.weight' is in two shards: {S1} and {S2}",
            id="tensor-in-two-shards-with-index",
        ),
        pytest.param(
            {S1: shard1(), S2: shard2()},
            index_of((S2, shard1()), (S1, shard2())),
            f"puts tensor '.*' in {S2}, but that shard's header does not hold it: it is in {S1}",
            id="weight-map-wrong-shard",
        ),
    ],
)
def test_shards_that_disagree_are_a_422_and_nothing_is_leased(
    root: Path, shards: dict[str, dict[str, np.ndarray]], index: bytes | None, match: str
) -> None:
    for name, tensors in shards.items():
        write(root, "nvme", f"models/bad/{name}", tensors)
    if index is not None:
        write(root, "nvme", f"models/bad/{INDEX}", index)
    with serve(root) as (admin, data, _srv):
        disk, before = disk_snapshot(root), catalog(admin)
        data.model("models/bad")  # the headers are read by a load only
        _bad_request(data, lambda: data.load_model("models/bad"), match)
        _bad_request(data, lambda: data.load_model("models/bad", names=["layers.0.w"]), match)
        assert admin.buffers()["items"] == []
        assert disk_snapshot(root) == disk and catalog(admin) == before


def test_bad_requests(root: Path) -> None:
    llama(root)
    with serve(root) as (admin, data, srv):
        disk, before = disk_snapshot(root), catalog(admin)
        http = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {DATA}"})
        bad: list[tuple[str, str, dict[str, Any], Any, int, str]] = [
            ("GET", "/v1/models/lookup", {"name": "../x"}, None, 422, "invalid_path"),
            ("GET", "/v1/models/lookup", {"name": "/abs"}, None, 422, "invalid_path"),
            ("GET", "/v1/models/lookup", {"name": "a//b"}, None, 422, "invalid_path"),
            ("GET", "/v1/models/lookup", {"name": ""}, None, 422, "invalid_path"),
            ("GET", "/v1/models/lookup", {}, None, 422, "invalid_request"),
            ("GET", "/v1/models/lookup", {"name": "x" * 5000}, None, 422, "invalid_request"),
            ("GET", "/v1/models", {"cursor": "bogus"}, None, 422, "invalid_cursor"),
            ("GET", "/v1/models", {"limit": 0}, None, 422, "invalid_request"),
            ("POST", "/v1/models/load", {"name": "models/nope"}, None, 404, "model_not_found"),
            (
                "POST",
                "/v1/models/load",
                {"name": "models/llama"},
                {"names": ["nope"]},
                422,
                "invalid_input",
            ),
            (
                "POST",
                "/v1/models/load",
                {"name": "models/llama"},
                {"prefix": "nope."},
                422,
                "invalid_input",
            ),
            (
                "POST",
                "/v1/models/load",
                {"name": "models/llama"},
                {"names": ["empty"], "prefix": "e"},
                422,
                "invalid_input",
            ),
            (
                "POST",
                "/v1/models/load",
                {"name": "models/llama"},
                {"device": "cuda:99"},
                422,
                "invalid_device",
            ),
            (
                "POST",
                "/v1/models/load",
                {"name": "models/llama"},
                {"ttl_s": -1},
                422,
                "invalid_request",
            ),
            (
                "POST",
                "/v1/models/load",
                {"name": "models/llama"},
                {"extra": 1},
                422,
                "invalid_request",
            ),
            (
                "POST",
                "/v1/models/prefetch",
                {"name": "models/llama"},
                {"target": "tape"},
                422,
                "invalid_request",
            ),
            (
                "POST",
                "/v1/models/prefetch",
                {"name": "models/llama"},
                {"target": "nvme", "device": "cpu"},
                422,
                "invalid_input",
            ),
            (
                "POST",
                "/v1/models/prefetch",
                {"name": "models/nope"},
                {"target": "nvme"},
                404,
                "model_not_found",
            ),
            ("POST", "/v1/models/pin", {"name": "models/llama"}, None, 403, "forbidden"),
            ("DELETE", "/v1/models/pin", {"name": "models/llama"}, None, 403, "forbidden"),
        ]
        for method, path, params, body, status, code in bad:
            r = http.request(method, path, params=params, json=body)
            assert r.status_code == status, (method, path, params, body, r.text)
            assert r.json()["error"]["code"] == code, (params, body, r.text)
        json_type = {"Content-Type": "application/json"}
        r = http.post(
            "/v1/models/load", params={"name": "models/llama"}, content=b"\xff", headers=json_type
        )
        assert r.status_code in (400, 422) and "error" in r.json()
        r = http.post("/v1/models/load", params={"name": "models/llama"}, content=b"\xff")
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        http.close()
        assert admin.buffers()["items"] == [] and data.request("GET", "/v1/jobs") == []
        assert disk_snapshot(root) == disk and catalog(admin) == before


def test_over_the_budget_leases_nothing(root: Path) -> None:
    write(root, "nvme", "models/big/a.safetensors", {"a": np.zeros(40 * MiB, np.uint8)})
    write(root, "nvme", "models/big/b.safetensors", {"b": np.zeros(40 * MiB, np.uint8)})
    with serve(root) as (admin, data, _srv):
        with pytest.raises(Exception) as exc:
            data.load_model("models/big")
        assert getattr(exc.value, "status", None) == 507
        assert admin.buffers()["items"] == []
        with data.load_model("models/big", names=["b"]) as t:
            assert np.asarray(t["b"]).nbytes == 40 * MiB


def test_cli_lists_models(root: Path) -> None:
    llama(root)
    runner = CliRunner()
    assert runner.invoke(cli, ["scan", "--data-dir", str(root)]).exit_code == 0
    result = runner.invoke(cli, ["models", "--data-dir", str(root), "--json"])
    assert result.exit_code == 0, result.output
    [m] = json.loads(result.output)
    assert (
        m["name"] == "models/llama" and m["file_count"] == 4 and set(m["tiers"]) == {"nvme", "hdd"}
    )
    result = runner.invoke(cli, ["models", "models/", "--data-dir", str(root)])
    assert result.exit_code == 0 and "models/llama" in result.output and "hdd" in result.output
    result = runner.invoke(cli, ["models", "other/", "--data-dir", str(root), "--json"])
    assert json.loads(result.output) == []
