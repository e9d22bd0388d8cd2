"""Model directories without a server: which files a model's weights are, and every way an
index or its shards can disagree (examples, then Hypothesis for the index parser)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiering.errors import InvalidInput, InvalidModel
from tiering.io import ModelLayout
from tiering.io.hfmodel import (
    CANONICAL_INDEX,
    MAX_INDEX_BYTES,
    check_unique_tensors,
    find_index,
    layout,
    model_name,
    parse_index,
    select_tensors,
)

S1, S2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def index(weight_map: object, **extra: object) -> bytes:
    return json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map, **extra}).encode()


def no_index(name: str) -> bytes:
    raise AssertionError(f"read {name}, but there is no index to read")


@pytest.mark.parametrize(
    ("relpath", "model"),
    [
        ("models/llama/model.safetensors", "models/llama"),
        ("a/b/c/model-00001-of-00009.safetensors", "a/b/c"),
        ("model.safetensors", None),  # a model is a directory, never a tier's root
        ("models/llama/config.json", None),
        ("models/llama/model.safetensors.index.json", None),
        ("models/llama/.safetensors", None),
        ("models/llama/model.safetensors.tmp", None),
    ],
)
def test_model_name(relpath: str, model: str | None) -> None:
    assert model_name(relpath) == model


def test_layout_without_index_is_every_weights_file_in_name_order() -> None:
    files = ["config.json", "b.safetensors", "tokenizer.json", "a.safetensors"]
    lay = layout("m", files, no_index)
    assert lay == ModelLayout("m", ("a.safetensors", "b.safetensors"))
    assert lay.weight_map is None and lay.index_file is None and lay.tensor_count is None


def test_layout_with_index_reads_it_and_loads_only_its_shards() -> None:
    wmap = {"b": S2, "a": S1, "c": S1}
    reads: list[str] = []

    def read(name: str) -> bytes:
        reads.append(name)
        return index(wmap)

    # consolidated.safetensors is beside the shards, as in some repositories: not loaded.
    files = [CANONICAL_INDEX, S2, S1, "consolidated.safetensors", "config.json"]
    lay = layout("org/m", files, read)
    assert reads == [CANONICAL_INDEX]
    assert lay.shards == (S1, S2) and lay.index_file == CANONICAL_INDEX
    assert dict(lay.weight_map or {}) == wmap and lay.tensor_count == 3
    with pytest.raises(TypeError):
        lay.weight_map["a"] = S2  # type: ignore[index]


def test_which_index() -> None:
    other = "diffusion_pytorch_model.safetensors.index.json"
    assert find_index(["a.safetensors"]) is None
    assert find_index([other, "x.safetensors"]) == other
    assert find_index([other, CANONICAL_INDEX]) == CANONICAL_INDEX
    with pytest.raises(InvalidModel, match="several indexes") as exc:
        find_index([other, "model.fp16.safetensors.index.json"])
    assert exc.value.code == "invalid_model"


def test_layout_errors_name_the_model() -> None:
    with pytest.raises(InvalidModel, match=r"model 'm': no \.safetensors weights"):
        layout("m", ["config.json"], no_index)
    with pytest.raises(InvalidModel, match=r"^model 'org/m': .*not in the model: " + S2) as exc:
        layout("org/m", [CANONICAL_INDEX, S1], lambda _n: index({"a": S1, "b": S2}))
    assert exc.value.details["model"] == "org/m"
    assert exc.value.details["missing"] == {S2: 1}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff\xfe not utf-8", "not UTF-8 JSON"),
        (b'{"weight_map": {', "not UTF-8 JSON"),
        (b"[1, 2]", "not a JSON object"),
        (
            b'{"metadata": {}}',
            "weight_map must be an object of tensor name → shard file, got nothing",
        ),
        (index([S1]), "weight_map must be an object .* got list"),
        (index("x"), "weight_map must be an object .* got str"),
        (index({}), "weight_map names no tensor"),
        (index({"a": 7}), "tensor 'a' maps to 7 is not a string"),
        (index({"a": "../model.safetensors"}), "is not a file name in the model's directory"),
        (index({"a": "sub/model.safetensors"}), "is not a file name in the model's directory"),
        (index({"a": "pytorch_model.bin"}), r"is not a \.safetensors file"),
        (index({"a": S1}, metadata=[1]), "metadata must be an object"),
        (
            f'{{"weight_map": {{"a": "{S1}", "a": "{S2}"}}}}'.encode(),
            f"tensor 'a' is mapped twice, to '{S1}' and to '{S2}'",
        ),
        (
            f'{{"weight_map": {{"a": "{S1}"}}, "weight_map": {{"a": "{S2}"}}}}'.encode(),
            "two different weight maps",
        ),
        (index({"a": S1, "b": S2, "c": S2}), rf"names 1 shard\(s\) .*: {S2} \(2 tensors\)"),
        (b"[" * 100_000 + b"]" * 100_000, "nests too deeply|not UTF-8 JSON"),
    ],
)
def test_bad_indexes(data: bytes, message: str) -> None:
    with pytest.raises(InvalidModel, match=message) as exc:
        parse_index(data, present=[S1])
    assert isinstance(exc.value, InvalidInput)  # a 422 over REST
    assert exc.value.details["index_file"] == CANONICAL_INDEX


def test_index_edge_cases_that_are_fine() -> None:
    # The same tensor twice, to the same shard: harmless, and kept once.
    same = f'{{"weight_map": {{"a": "{S1}", "a": "{S1}"}}}}'.encode()
    assert parse_index(same, present=[S1]) == {"a": S1}
    # A byte order mark (some editors write one); no metadata at all.
    assert parse_index(b"\xef\xbb\xbf" + index({"a": S1}), present=[S1]) == {"a": S1}
    assert parse_index(json.dumps({"weight_map": {"a": S1}}).encode(), present=[S1]) == {"a": S1}


def test_oversized_index() -> None:
    with pytest.raises(InvalidModel, match="over the .* byte limit"):
        parse_index(
            b" " * (MAX_INDEX_BYTES + 1), present=[S1], index_file="x.safetensors.index.json"
        )


def test_missing_shards_are_listed_with_their_tensor_counts() -> None:
    shards = [f"model-{i:05d}-of-00009.safetensors" for i in range(1, 10)]
    wmap = {f"t{i}": shards[i % 9] for i in range(40)}
    with pytest.raises(InvalidModel) as exc:
        parse_index(index(wmap), present=shards[:2])
    assert "names 7 shard(s) that are not in the model" in exc.value.message
    assert "and 2 more" in exc.value.message
    missing: dict[str, int] = exc.value.details["missing"]  # type: ignore[assignment]
    assert sum(missing.values()) == sum(1 for s in wmap.values() if s not in shards[:2])


def test_check_unique_tensors() -> None:
    check_unique_tensors({S1: ["a", "b"], S2: ["c"]}, {"a": S1, "b": S1, "c": S2})
    check_unique_tensors({S1: ["a"], S2: ["b"]}, None)
    with pytest.raises(InvalidModel, match=f"tensor 'b' is in two shards: {S1} and {S2}") as exc:
        check_unique_tensors({S1: ["a", "b"], S2: ["b"]}, None)
    assert exc.value.details["shards"] == [S1, S2]
    with pytest.raises(InvalidModel, match=f"puts tensor 'a' in {S2}.*it is in {S1}"):
        check_unique_tensors({S1: ["a"], S2: ["b"]}, {"a": S2, "b": S2})
    with pytest.raises(InvalidModel, match=r"puts tensor 'z' in .*no shard has it \(2 entries"):
        check_unique_tensors({S1: ["a"], S2: ["b"]}, {"a": S1, "z": S1, "y": S2, "b": S2})
    # A tensor the map does not name is loaded with its shard (transformers ignores it too).
    check_unique_tensors({S1: ["a", "extra"]}, {"a": S1})


def test_select_tensors() -> None:
    names = ["enc.0.w", "enc.0.b", "dec.0.w"]
    assert select_tensors(names) is None
    assert select_tensors(names, prefix="enc.") == ["enc.0.w", "enc.0.b"]
    assert select_tensors(names, names=["dec.0.w", "enc.0.b", "dec.0.w"]) == ["dec.0.w", "enc.0.b"]
    with pytest.raises(InvalidInput, match="not both"):
        select_tensors(names, names=["enc.0.w"], prefix="enc.")
    with pytest.raises(InvalidInput, match=r"1 tensor\(s\) not in the model: 'nope'"):
        select_tensors(names, names=["enc.0.w", "nope"])
    with pytest.raises(InvalidInput, match="no tensor name starts with 'x'"):
        select_tensors(names, prefix="x")


# -- Hypothesis ----------------------------------------------------------------------------------
_tensor = st.text(min_size=1, max_size=12)
_shard = st.sampled_from([f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)])


@given(st.dictionaries(_tensor, _shard, min_size=1, max_size=30), st.data())
def test_index_round_trip_and_missing_shards(wmap: dict[str, str], data: st.DataObject) -> None:
    shards = sorted(set(wmap.values()))
    assert parse_index(index(wmap), present=[*shards, "config.json"]) == wmap
    gone = data.draw(st.sampled_from(shards))
    with pytest.raises(InvalidModel) as exc:
        parse_index(index(wmap), present=[s for s in shards if s != gone])
    assert exc.value.details["missing"] == {gone: sum(s == gone for s in wmap.values())}
    assert gone in exc.value.message


@given(st.dictionaries(_tensor, _shard, min_size=1, max_size=10), st.data())
def test_a_tensor_given_twice_is_caught(wmap: dict[str, str], data: st.DataObject) -> None:
    tensor = data.draw(st.sampled_from(sorted(wmap)))
    other = data.draw(_shard.filter(lambda s: s != wmap[tensor]))
    body = json.dumps(wmap)[1:-1] + ", " + json.dumps({tensor: other})[1:-1]
    raw = ('{"weight_map": {' + body + "}}").encode()
    with pytest.raises(InvalidModel, match="is mapped twice") as exc:
        parse_index(raw, present=[*wmap.values(), other])
    assert exc.value.details["tensor"] == tensor


@given(st.binary(max_size=200))
def test_any_bytes_are_an_index_or_a_clear_error(raw: bytes) -> None:
    try:
        wmap = parse_index(raw, present=[])
    except InvalidModel as exc:
        assert exc.message.startswith(CANONICAL_INDEX)
    else:
        raise AssertionError(f"{raw!r} parsed to {wmap} with no shard present")
