"""Torch state dicts over REST (``Client.load_state_dict``) and in-process
(``tiering.io.state_dict``): exact dtypes, no copy, and leases that live exactly as long as
the tensors, against a real tierd on loopback."""

from __future__ import annotations

import gc
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import LiveServer, wait_for
from tests.models.torch_support import (
    leases,
    model_server,
    raw,
    renewers,
    run_child,
    tiny_model,
)
from tierd_client import Client, InvalidRequest, NotFound
from tiering.errors import FileNotFound, InvalidInput, InvalidModel
from tiering.io import GpuDirectStorage, read_header
from tiering.io.state_dict import load_state_dict, model_shards

torch = pytest.importorskip("torch", reason="torch is not installed (make installs its CPU build)")
st_torch = pytest.importorskip("safetensors.torch")

MODEL = "models/tiny"
SHARD = f"{MODEL}/model.safetensors"


@pytest.fixture
def original() -> dict[str, Any]:
    return tiny_model(torch)


@pytest.fixture
def server(data_dir: Path, tmp_path: Path, original: dict[str, Any]) -> Iterator[LiveServer]:
    src = tmp_path / "model.safetensors"
    st_torch.save_file(original, str(src))
    with model_server(data_dir, {SHARD: src}) as srv:
        yield srv


@pytest.fixture
def api(server: LiveServer) -> Iterator[Client]:
    with Client(server.url) as c:
        yield c


def assert_same(sd: dict[str, Any], original: dict[str, Any]) -> None:
    assert sorted(sd) == sorted(original)
    for name, want in original.items():
        got = sd[name]
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert got.device.type == "cpu"
        assert torch.equal(raw(got), raw(want)), name


@pytest.mark.parametrize("source", [MODEL, SHARD, [SHARD]], ids=["model", "file", "files"])
def test_exact_dtypes_by_model_name_or_files(
    api: Client, original: dict[str, Any], source: Any
) -> None:
    sd = api.load_state_dict(source)
    assert_same(sd, original)
    assert {str(sd[n].dtype) for n in sd} >= {
        "torch.bfloat16",
        "torch.float16",
        "torch.float32",
        "torch.float8_e4m3fn",
        "torch.int64",
        "torch.bool",
    }


def test_one_export_per_buffer_and_dtype_and_misaligned_tensors(
    data_dir: Path, tmp_path: Path
) -> None:
    """The state dict's tensors are views of one torch tensor per buffer and dtype (one DLPack
    export each, not one per tensor); a tensor whose offset is not a whole number of its items
    (the format allows it; torch's writer never does it) gets its own, with the right bytes."""
    a = np.arange(3, dtype=np.uint8)
    b = np.array([1.5, -2.25, 3.0], dtype=np.float32)  # at byte 3: misaligned
    c = np.array([7.0, 8.0], dtype=np.float32)  # at byte 15: misaligned too
    d = np.array([9, 10], dtype=np.uint8)
    header = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "F32", "shape": [3], "data_offsets": [3, 15]},
        "c": {"dtype": "F32", "shape": [2], "data_offsets": [15, 23]},
        "d": {"dtype": "U8", "shape": [2], "data_offsets": [23, 25]},
    }
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    blob = struct.pack("<Q", len(head)) + head + a.tobytes() + b.tobytes() + c.tobytes()
    blob += d.tobytes()
    with model_server(data_dir, {"odd/w.safetensors": blob}) as srv, Client(srv.url) as api:
        sd = api.load_state_dict("odd/w.safetensors")
        assert sd["a"].tolist() == [0, 1, 2] and sd["d"].tolist() == [9, 10]
        assert sd["b"].tolist() == [1.5, -2.25, 3.0] and sd["c"].tolist() == [7.0, 8.0]
        # The aligned u8 tensors share one storage; the misaligned ones have their own.
        ptr = sd["a"].untyped_storage().data_ptr()
        assert sd["d"].untyped_storage().data_ptr() == ptr
        assert sd["d"].data_ptr() - sd["a"].data_ptr() == 23
        assert sd["b"].untyped_storage().data_ptr() != ptr
        del sd


def test_tensors_view_the_lease_memory(
    api: Client, original: dict[str, Any], tmp_path: Path
) -> None:
    """Bytes written through a second mapping of the lease show in every tensor: they are
    views of the service's shared memory, not copies."""
    sd = api.load_state_dict(MODEL)
    (lease,) = leases(api)
    with api.open_buffer(lease, release_on_close=False) as other:
        view = other.array.view("uint8")
        view[:] = ~view
        for name, want in original.items():
            if want.numel():
                assert torch.equal(raw(sd[name]), ~raw(want)), name
        view[:] = ~view
    assert_same(sd, original)
    # One shard, one allocation: the tensors lie as the file lays them out.
    header = read_header(tmp_path / "model.safetensors").tensors
    first = min((t for t in header.values() if t.nbytes), key=lambda t: t.begin)
    for name, t in header.items():
        if t.nbytes:
            assert sd[name].data_ptr() - sd[first.name].data_ptr() == t.begin - first.begin


# The TTL leaves the renewer (every TTL / 3) four seconds of slack: on a loaded 2-core machine a
# renewal due every half second came more than a second late, and with the suite's workers on
# the same cores (pytest-xdist) one due every second came more than two seconds late.
TTL_S = 6.0


def test_leases_outlive_their_ttl_while_tensors_live(api: Client, original: dict[str, Any]) -> None:
    sd = api.load_state_dict(MODEL, ttl_s=TTL_S)
    mine = set(leases(api))
    assert len(mine) == 1

    def outlive_a_ttl() -> None:
        # A lease nobody renews, made after ours with the same TTL, expires (so the reaper
        # runs and the TTL is real); ours must still be there after it.
        control = api.load_safetensors([SHARD], ttl_s=TTL_S)
        gone = {b.id for b in control.buffers}
        wait_for(lambda: not gone & set(leases(api)), what="the unrenewed lease to expire")
        control.close()
        assert mine <= set(leases(api))

    outlive_a_ttl()
    assert_same(sd, original)
    # A parameter made from a tensor shares its memory: it alone keeps the leases.
    param = torch.nn.Parameter(sd["layer.0.bias"])
    del sd
    gc.collect()
    outlive_a_ttl()
    assert torch.equal(param.detach(), original["layer.0.bias"])
    del param
    wait_for(lambda: not mine & set(leases(api)), what="the leases to be released")
    wait_for(lambda: not renewers(), what="the renewer to stop")


def test_a_service_gone_is_given_up_after_a_ttl(
    data_dir: Path, tmp_path: Path, original: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Tensors that outlive the service: renewals fail, and after a TTL of failures the
    renewer gives up (the service freed the leases) and stops, instead of logging for ever."""
    src = tmp_path / "model.safetensors"
    st_torch.save_file(original, str(src))
    with model_server(data_dir, {SHARD: src}) as srv:
        api = Client(srv.url)
        sd = api.load_state_dict(MODEL, ttl_s=0.5)
    try:
        wait_for(lambda: not renewers(), what="the renewer to give up")
    finally:
        api.close()
    said = [r.getMessage() for r in caplog.records if r.name.startswith("tierd_client")]
    assert any("giving up on 1 lease(s)" in m for m in said), said
    assert len(said) < 20, said
    assert_same(sd, original)  # the bytes are still mapped: only the lease is gone


def test_released_when_the_last_tensor_is_collected(api: Client) -> None:
    sd = api.load_state_dict(MODEL)
    assert leases(api)
    weight = sd["layer.1.weight"].view(-1)[3:]  # a view of a view
    del sd
    gc.collect()
    assert leases(api)
    # In a reference cycle the tensor goes with the garbage collector, in whatever thread.
    cycle: list[Any] = [weight]
    cycle.append(cycle)
    del weight, cycle
    gc.collect()
    wait_for(lambda: not leases(api), what="the leases to be released")
    wait_for(lambda: not renewers(), what="the renewer to stop")


def test_one_renewer_per_client(api: Client, server: LiveServer) -> None:
    a = api.load_state_dict(MODEL)
    b = api.load_state_dict(SHARD, names=["mask"])
    assert len(leases(api)) == 2
    assert len(renewers()) == 1
    with Client(server.url) as other:
        c = other.load_state_dict(MODEL, prefix="layer.")
        assert sorted(c) == ["layer.0.bias", "layer.0.weight", "layer.1.scale", "layer.1.weight"]
        assert len(renewers()) == 2
        del c
        wait_for(lambda: len(leases(api)) == 2, what="the second client's lease released")
    del a, b
    wait_for(lambda: not leases(api) and not renewers(), what="everything released")


def test_closing_the_client_releases_and_stops(
    server: LiveServer, original: dict[str, Any]
) -> None:
    with Client(server.url) as api:
        sd = api.load_state_dict(MODEL)
        assert leases(api)
    assert not renewers()
    with Client(server.url) as look:
        assert leases(look) == []
    # On cpu the mapping outlives the lease: the tensors still read their bytes.
    assert_same(sd, original)


def test_empty_selection_leases_nothing(api: Client) -> None:
    assert api.load_state_dict(SHARD, names=[]) == {}
    wait_for(lambda: not leases(api) and not renewers(), what="nothing held")


@pytest.mark.parametrize(
    ("source", "kwargs", "error"),
    [
        ("models/nope", {}, NotFound),
        ("models/nope/model.safetensors", {}, NotFound),
        (SHARD, {"names": ["no.such.tensor"]}, InvalidRequest),
        (MODEL, {"names": ["no.such.tensor"]}, InvalidRequest),
        (MODEL, {"prefix": "no.such."}, InvalidRequest),
        (MODEL, {"device": "tpu:0"}, InvalidRequest),
        (SHARD, {"prefix": "layer."}, TypeError),
    ],
)
def test_bad_input_leases_nothing(
    api: Client, source: Any, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        api.load_state_dict(source, **kwargs)
    assert leases(api) == []
    assert not renewers()


CUDA_CHILD = """
import gc, json, sys, time
import torch
from tests.models.torch_support import raw
from tierd_client import Client
from tiering.io import read_header

args = json.loads(sys.argv[1])
want = torch.load(args["want"])
with Client(args["url"]) as api:
    def live():
        return {b["buffer_id"] for b in api.buffers()["items"]}

    def outlive_a_ttl(mine):
        control = api.load_safetensors([args["shard"]], device="cuda:0", ttl_s=0.5)
        gone = {b.id for b in control.buffers}
        while gone & live():
            time.sleep(0.02)
        control.close()
        assert mine <= live(), "a lease of the state dict expired"

    sd = api.load_state_dict(args["model"], device="cuda:0", ttl_s=0.5)
    mine = live()
    for name, w in want.items():
        t = sd[name]
        assert t.device == torch.device("cuda", 0) and t.dtype == w.dtype, name
        assert t.shape == w.shape and torch.equal(raw(t).cpu(), raw(w)), name
    header = read_header(args["file"]).tensors
    first = min((t for t in header.values() if t.nbytes), key=lambda t: t.begin)
    for name, t in header.items():
        if t.nbytes:
            assert sd[name].data_ptr() - sd[first.name].data_ptr() == t.begin - first.begin
    outlive_a_ttl(mine)
    param = torch.nn.Parameter(sd["layer.0.bias"])
    del sd
    gc.collect()
    outlive_a_ttl(mine)
    assert torch.equal(param.detach().cpu(), want["layer.0.bias"])
    del param
    gc.collect()
    deadline = time.monotonic() + 20
    while mine & live() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not mine & live(), "leases left after the tensors went"
print("child ok")
"""


@pytest.mark.gpu
def test_cuda_state_dict_in_a_second_process(
    api: Client, server: LiveServer, original: dict[str, Any], tmp_path: Path
) -> None:
    torch.save(original, tmp_path / "want.pt")
    args = {
        "url": server.url,
        "model": MODEL,
        "shard": SHARD,
        "file": str(tmp_path / "model.safetensors"),
        "want": str(tmp_path / "want.pt"),
    }
    run_child(CUDA_CHILD, args)
    assert leases(api) == []


@pytest.mark.gpu
def test_in_process_into_cuda(tmp_path: Path, original: dict[str, Any]) -> None:
    sd = load_state_dict(sharded(tmp_path / "m", original), device="cuda:0")
    for name, want in original.items():
        assert sd[name].device == torch.device("cuda", 0)
        assert sd[name].dtype == want.dtype
        assert torch.equal(raw(sd[name]).cpu(), raw(want)), name


# -- in-process: tiering.io.state_dict ---------------------------------------------------------


def sharded(root: Path, original: dict[str, Any], index: dict[str, Any] | None = None) -> Path:
    """``original`` split over two shards with an index, as transformers saves large models."""
    names = sorted(original)
    half = {n: original[n] for n in names[: len(names) // 2]}
    rest = {n: original[n] for n in names[len(names) // 2 :]}
    root.mkdir(parents=True, exist_ok=True)
    st_torch.save_file(half, str(root / "model-00001-of-00002.safetensors"))
    st_torch.save_file(rest, str(root / "model-00002-of-00002.safetensors"))
    wmap = {n: "model-00001-of-00002.safetensors" for n in half}
    wmap |= {n: "model-00002-of-00002.safetensors" for n in rest}
    doc = index if index is not None else {"metadata": {}, "weight_map": wmap}
    (root / "model.safetensors.index.json").write_text(json.dumps(doc))
    (root / "config.json").write_text("{}")
    return root


def test_in_process_model_directory(tmp_path: Path, original: dict[str, Any]) -> None:
    root = sharded(tmp_path / "m", original)
    sd = load_state_dict(root)
    assert_same(sd, original)
    assert model_shards(root) == [
        root / "model-00001-of-00002.safetensors",
        root / "model-00002-of-00002.safetensors",
    ]
    # Each shard is one allocation, and every tensor a view of it where the file puts it.
    for shard in model_shards(root):
        header = read_header(shard).tensors
        first = min((t for t in header.values() if t.nbytes), key=lambda t: t.begin)
        for name, t in header.items():
            if t.nbytes:
                assert sd[name].data_ptr() - sd[first.name].data_ptr() == t.begin - first.begin
    # The tensors alone keep the memory: nothing else refers to it, and it still reads right.
    bias = sd["layer.0.bias"]
    del sd
    gc.collect()
    _ = [bytearray(1 << 16) for _ in range(64)]  # reuse of freed memory would show here
    assert torch.equal(bias, original["layer.0.bias"])


def test_in_process_files_names_and_prefix(tmp_path: Path, original: dict[str, Any]) -> None:
    root = sharded(tmp_path / "m", original)
    shards = model_shards(root)
    assert_same(load_state_dict(shards), original)
    one = load_state_dict(shards[0])
    assert set(one) < set(original)
    assert sorted(load_state_dict(root, prefix="layer.1.")) == ["layer.1.scale", "layer.1.weight"]
    assert list(load_state_dict(root, names=["mask"])) == ["mask"]
    with GpuDirectStorage("cpu") as gds:
        assert_same(load_state_dict(root, storage=gds), original)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda p, o: p / "absent", FileNotFound, "no such model"),
        (lambda p, o: p, InvalidModel, "no .safetensors weights"),
        (
            lambda p, o: sharded(p / "m", o, {"weight_map": {"x": "model-00009.safetensors"}}),
            InvalidModel,
            "not in the model: model-00009.safetensors",
        ),
        (
            lambda p, o: sharded(
                p / "m", o, {"weight_map": {"mask": "model-00001-of-00002.safetensors"}}
            ),
            InvalidModel,
            "the weight map puts tensor 'mask' in model-00001-of-00002.safetensors",
        ),
    ],
    ids=["no-such-path", "no-weights", "index-names-a-missing-shard", "index-disagrees"],
)
def test_in_process_bad_models(
    tmp_path: Path, original: dict[str, Any], make: Any, error: type[Exception], match: str
) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(error, match=match):
        load_state_dict(make(tmp_path, original))


def test_in_process_tensor_in_two_shards(tmp_path: Path, original: dict[str, Any]) -> None:
    st_torch.save_file({"a": original["mask"]}, str(tmp_path / "x.safetensors"))
    st_torch.save_file({"a": original["mask"]}, str(tmp_path / "y.safetensors"))
    with pytest.raises(InvalidModel, match="'a' is in two shards"):
        load_state_dict(tmp_path)


def test_in_process_bad_selection(tmp_path: Path, original: dict[str, Any]) -> None:
    root = sharded(tmp_path / "m", original)
    with pytest.raises(InvalidInput, match="not in the model"):
        load_state_dict(root, names=["nope"])
    with pytest.raises(InvalidInput, match="no tensor name starts with"):
        load_state_dict(root, prefix="nope.")
    with pytest.raises(InvalidInput, match="names or prefix, not both"):
        load_state_dict(root, names=["mask"], prefix="layer.")
    with GpuDirectStorage("cpu") as gds, pytest.raises(InvalidInput, match="not both"):
        load_state_dict(root, device="cpu", storage=gds)
