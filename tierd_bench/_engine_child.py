"""One engine process of ``tierd bench engine``: start, import, build the model, load its
weights one way, run the first forward pass, report each phase, check every tensor, exit.

Run by :mod:`._engine_rows` as a fresh interpreter (``python -c`` with
:func:`runpy.run_path` on this file, so that neither ``tierd_bench`` nor anything else is
imported before the clock starts) with one JSON argument; it prints one JSON line. Its
clock is ``time.perf_counter()`` from the first line of this file, and the interpreter's own
start (before that line) is ``time.time()`` now less ``spawn``, the wall time the parent
read just before it started the process. The phases, in seconds:

- ``startup``: from the spawn to this file's first line (the interpreter's start);
- ``imports``: torch and transformers (the auto class and the architecture's module);
- ``loader_import``: the loader's library (tierd_client, fastsafetensors; for
  ``from_pretrained``, ``safetensors.torch``, which transformers imports when it loads);
- ``cuda``: the device's CUDA context (``torch.zeros(1, device=...)``, synchronised; 0 on cpu);
- ``setup``: the loader's object (tierd's ``Client``, fastsafetensors' file loader; ``None``
  for ``from_pretrained``);
- ``construct``: ``AutoConfig`` and ``AutoModelForCausalLM.from_config`` on the meta device,
  the rotary embedding's buffers made on the device (``None`` for ``from_pretrained``, which
  builds and loads in one call: its ``weights``);
- ``weights``: the state dict onto the device and into the model (``load_state_dict(...,
  assign=True)``), synchronised;
- ``forward``: the first forward pass on 16 tokens and its argmax, the first token;
- ``ttft``: from the spawn to that token.

Then, off the clock, every tensor of the model is compared with the file's (``torch.equal``
on the device, one tensor at a time through ``safetensors.safe_open``), and every parameter
and buffer must be on the device: a wrong or missing byte fails the process.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()
W0 = time.time()

import importlib  # noqa: E402  (after the clock: the clock is the point)
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

_LIBRARY = {
    "transformers": "safetensors.torch",
    "fastsafetensors": "fastsafetensors",
    "tierd": "tierd_client",
}
_PROMPT = 16


class _Laps:
    """Seconds since the last lap, per phase."""

    def __init__(self, out: dict[str, Any]) -> None:
        self.out, self.last = out, T0
        self.sync: Callable[[], None] = lambda: None

    def __call__(self, phase: str) -> None:
        self.sync()
        now = time.perf_counter()
        self.out[phase] = now - self.last
        self.last = now


def _device_sync(torch: Any, device: str) -> Callable[[], None]:
    if not device.startswith("cuda"):
        return lambda: None
    return lambda: torch.cuda.synchronize(device)


def _meta_model(torch: Any, transformers: Any, args: dict[str, Any]) -> Any:
    """The model built on the meta device (no memory, no init), its rotary embedding's
    buffers (not in the checkpoint: computed from the config) made on the device."""
    cfg = transformers.AutoConfig.from_pretrained(args["model_dir"])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if not name.endswith("rotary_emb"):
                raise RuntimeError(f"{name} has buffers no checkpoint holds")
            owner, _, attr = name.rpartition(".")
            with torch.device(args["device"]):
                setattr(model.get_submodule(owner), attr, type(module)(config=cfg))
    return model


_Loaded = tuple[dict[str, Any], Callable[[], None]]


def _fastsafetensors(args: dict[str, Any], laps: _Laps) -> _Loaded:
    fst = importlib.import_module("fastsafetensors")
    loader = fst.SafeTensorsFileLoader(
        fst.SingleGroup(),
        args["device"],
        nogds=True,  # no nvidia-fs on the GPU machines: its pread path, as the models bench
        max_threads=args["fst_threads"],
        bbuf_size_kb=args["fst_bbuf_kb"],
    )
    laps("setup")
    args["make_model"]()
    laps("construct")
    loader.add_filenames({0: args["files"]})
    fb = loader.copy_files_to_device()

    def close() -> None:
        fb.close()
        loader.close()

    return {k: fb.get_tensor(k) for k in loader.get_keys()}, close


def _tierd(args: dict[str, Any], laps: _Laps) -> _Loaded:
    client = importlib.import_module("tierd_client")
    api = client.Client(args["url"], token=args.get("token"), timeout=600)
    laps("setup")
    args["make_model"]()
    laps("construct")
    sd = api.load_state_dict(args["name"], device=args["device"], shared=args["shared"])
    return sd, api.close  # closed at the end: its thread renews the leases until then


def _load(
    torch: Any, transformers: Any, args: dict[str, Any], laps: _Laps
) -> tuple[Any, Callable[[], None]]:
    """The model with its weights on the device, and what frees the loader's hold on them."""
    device, loader = args["device"], args["loader"]
    if loader == "transformers":
        laps.out["setup"] = None  # from_pretrained makes no loader object of its own
        # device_map needs accelerate; without it (or on cpu, the default) a cpu load.
        where = {"device_map": device} if args["device_map"] else {}
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args["model_dir"], dtype=torch.bfloat16, **where
        )
        if not args["device_map"] and device != "cpu":
            model.to(device)
        laps("weights")
        return model, lambda: None
    holder: dict[str, Any] = {}

    def make_model() -> Any:
        holder["model"] = _meta_model(torch, transformers, args)
        return holder["model"]

    args["make_model"] = make_model
    sd, close = (_fastsafetensors if loader == "fastsafetensors" else _tierd)(args, laps)
    model = holder["model"]
    model.load_state_dict(sd, assign=True, strict=True)
    del sd
    laps("weights")
    return model, close


def _check(torch: Any, model: Any, files: list[str], device: str) -> int:
    """Every tensor equal to the file's and on ``device``; the bytes compared."""
    from safetensors import safe_open

    want = torch.device(device)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device != want and not (want.type == "cuda" and t.device.type == "cuda"):
            raise AssertionError(f"{name} is on {t.device}, not {device}")
    state = model.state_dict()
    seen, nbytes = set(), 0
    for f in files:
        with safe_open(f, "pt", device=device) as st:
            for key in st.keys():  # noqa: SIM118  (safe_open is not a mapping)
                t = st.get_tensor(key)
                if key not in state or not torch.equal(state[key], t):
                    raise AssertionError(f"{key} differs from {os.path.basename(f)}'s")
                seen.add(key)
                nbytes += t.numel() * t.element_size()
    if seen != set(state):
        raise AssertionError(f"not in the files: {sorted(set(state) - seen)[:5]}")
    return nbytes


def main() -> None:
    args = json.loads(sys.argv[-1])
    out: dict[str, Any] = {"startup": W0 - args["spawn"]}
    laps = _Laps(out)
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")
    # transformers imports lazily: the auto class and the architecture's own module are
    # imports too, not the model's construction (the engine knows its architecture).
    with open(os.path.join(args["model_dir"], "config.json")) as f:
        for arch in ["AutoModelForCausalLM", *json.load(f)["architectures"]]:
            getattr(transformers, arch)
    laps("imports")
    importlib.import_module(_LIBRARY[args["loader"]])
    laps("loader_import")
    device = args["device"]
    laps.sync = _device_sync(torch, device)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
    laps("cuda")
    model, close = _load(torch, transformers, args, laps)
    model.eval()
    with torch.inference_mode():
        ids = torch.arange(_PROMPT, device=device).remainder(model.config.vocab_size)[None]
        out["token"] = int(model(ids).logits[0, -1].argmax())
    laps("forward")
    out["ttft"] = W0 - args["spawn"] + (time.perf_counter() - T0)
    out.setdefault("construct", None)
    out["checked_bytes"] = _check(torch, model, args["files"], device) if args["check"] else 0
    del model
    close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
