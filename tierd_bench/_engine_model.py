"""The model ``tierd bench engine`` loads: a Llama-architecture causal LM with random bf16
weights, written once by ``save_pretrained`` as a Hugging Face directory of a few safetensors
shards, and kept in a cache directory between runs.

The shape follows the parameter budget (:func:`llama_shape`): on a GPU host the default (about
8 GB) is Llama-2-7B's layer (hidden 4096, MLP 11008, 32 heads, 8 KV heads, a 32,000-token
vocabulary) repeated as often as the budget allows, so every tensor is a real model's size and
the weights phase moves real shapes; small budgets (a CPU run in CI) scale the hidden size
down until at least four layers fit. Weights are ``N(0, 0.02)`` in bf16: a forward pass gives
finite logits, so the first token is a real argmax.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["LlamaShape", "cached_model", "llama_shape"]

#: Hidden sizes tried, largest first: the first that fits four layers in the budget is used.
_HIDDEN = (4096, 2048, 1024, 512, 256, 128, 64)
_MIN_LAYERS = 4
#: Shards ``save_pretrained`` writes (about): an engine reads several files, as it would a
#: real checkpoint's, and a loader that overlaps files shows it.
SHARDS = 3
_DONE = ".tierd-bench-complete"  # written last: a half-written cache entry is rewritten


@dataclass(frozen=True)
class LlamaShape:
    """A Llama config's sizes, and the parameter count they give."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def params(self) -> int:
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate + 2 * h
        return 2 * self.vocab * h + self.layers * layer + h

    @property
    def weight_bytes(self) -> int:
        return 2 * self.params  # bf16

    @property
    def tag(self) -> str:
        return f"llama-h{self.hidden}-l{self.layers}-v{self.vocab}"


def _shape(hidden: int, layers: int) -> LlamaShape:
    head_dim = 128 if hidden >= 1024 else 32
    heads = max(1, hidden // head_dim)
    # MLP 8/3 of the hidden size, rounded as Llama rounds it (to 256; 11008 at 4096).
    inter = 11008 if hidden == 4096 else max(64, -(-hidden * 8 // 3 // 64) * 64)
    vocab = 32000 if hidden >= 1024 else 8 * hidden
    return LlamaShape(hidden, inter, layers, heads, max(1, heads // 4), vocab)


def llama_shape(nbytes: int) -> LlamaShape:
    """The shape whose bf16 weights come closest to ``nbytes``, with at least four layers."""
    for hidden in _HIDDEN:
        empty = _shape(hidden, 0)
        layer = _shape(hidden, 1).weight_bytes - empty.weight_bytes
        layers = round((nbytes - empty.weight_bytes) / layer)
        if layers >= _MIN_LAYERS:
            return _shape(hidden, layers)
    return _shape(_HIDDEN[-1], _MIN_LAYERS)


def _config(shape: LlamaShape) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def _write(shape: LlamaShape, out: Path) -> None:
    import importlib

    import torch

    auto: Any = importlib.import_module("transformers").AutoModelForCausalLM  # untyped
    cfg = _config(shape)
    with torch.device("meta"):
        model = auto.from_config(cfg, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(39)
    # Tensor by tensor, in float32 then bf16: a whole model's float32 copy at once would be
    # twice its size in RAM.
    weights = {
        name: torch.randn(p.shape, generator=gen).mul_(0.02).to(torch.bfloat16)
        if name.endswith("proj.weight") or "embed" in name or "lm_head" in name
        else torch.ones(p.shape, dtype=torch.bfloat16)  # the norms' scales, as initialised
        for name, p in model.state_dict().items()
    }
    model.load_state_dict(weights, assign=True, strict=True)
    # A little over a third: the last shard takes the remainder, not a fourth file.
    shard = max(1 << 10, shape.weight_bytes // SHARDS * 21 // 20)
    model.save_pretrained(out, max_shard_size=shard, safe_serialization=True)


def cached_model(cache: Path, nbytes: int, say: Any = lambda s: None) -> tuple[Path, LlamaShape]:
    """The model of about ``nbytes`` under ``cache`` (written first if absent or incomplete):
    its directory (``config.json``, ``model.safetensors.index.json`` and the shards)."""
    shape = llama_shape(nbytes)
    out = cache / shape.tag
    if (out / _DONE).exists():
        return out, shape
    shutil.rmtree(out, ignore_errors=True)
    say(f"writing a {shape.weight_bytes / 1e9:.3g} GB Llama model ({shape.tag}) to {out}")
    # In a process of its own: this one never imports torch (nor starts transformers' and
    # tqdm's threads), and the memory of the model's random weights goes back at its exit.
    code = "import sys; from tierd_bench._engine_model import _main; _main(sys.argv[1])"
    doc = json.dumps({"shape": asdict(shape), "out": str(out)})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    done = subprocess.run([sys.executable, "-c", code, doc], env=env, capture_output=True)
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip()[-3000:]
        raise RuntimeError(f"writing the model failed: {tail}")
    if not (out / "model.safetensors.index.json").exists():
        # One shard only (a tiny model): an index anyway, as a sharded checkpoint has.
        _index(out)
    (out / _DONE).write_text(json.dumps(asdict(shape)))
    return out, shape


def _main(doc: str) -> None:
    args = json.loads(doc)
    _write(LlamaShape(**args["shape"]), Path(args["out"]))


def _index(out: Path) -> None:
    from safetensors import safe_open

    weight_map: dict[str, str] = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            weight_map |= dict.fromkeys(st.keys(), f.name)
    doc = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(doc))
