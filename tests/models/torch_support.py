"""Helpers of the torch tests: a real tierd whose tier directory holds model files, and a small
synthetic model of every dtype that matters."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.conftest import LiveServer, make_settings, wait_for
from tierd_client import Client

MiB = 1 << 20
RENEWER = "tierd-lease-renewer"


def tiny_model(torch: Any) -> dict[str, Any]:
    """One tensor of each dtype a checkpoint carries, with values that tell them apart."""
    g = torch.Generator().manual_seed(13)
    return {
        "embed.weight": torch.randn(37, 16, generator=g).to(torch.bfloat16),
        "layer.0.weight": torch.randn(16, 16, generator=g).to(torch.float16),
        "layer.0.bias": torch.randn(16, generator=g),
        "layer.1.scale": torch.randn(3, 5, generator=g).to(torch.float8_e4m3fn),
        "layer.1.weight": torch.randn(16, 8, generator=g, dtype=torch.float64),
        "position_ids": torch.arange(512, dtype=torch.int64).reshape(1, 512),
        "mask": torch.rand(7, generator=g) > 0.5,
        "empty": torch.zeros(0, 4),
    }


@contextmanager
def model_server(
    data_dir: Path, files: Mapping[str, Path | bytes], **buffers: Any
) -> Iterator[LiveServer]:
    """A real tierd (uvicorn on loopback) whose ``nvme`` tier holds ``files`` (relpath → the
    file to copy, or bytes) from the start; returns once the catalog lists them all."""
    for rel, src in files.items():
        dst = data_dir / "nvme" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(src, bytes):
            dst.write_bytes(src)
        else:
            shutil.copyfile(src, dst)
    settings = make_settings(
        data_dir,
        watch=False,
        buffers={"reap_interval_s": 0.05, "cpu_budget_bytes": 512 * MiB, **buffers},
    )
    with LiveServer(settings) as srv:
        with Client(srv.url) as c:
            wait_for(lambda: {f["path"] for f in c.files()} >= set(files), what="the scan at start")
        yield srv


def leases(api: Client) -> list[str]:
    return [b["buffer_id"] for b in api.buffers()["items"]]


def renewers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == RENEWER and t.is_alive()]


def shm_name(api: Client, buffer_id: str) -> str:
    return str(api.request("GET", f"/v1/buffers/{buffer_id}")["handle"]["name"])


def pid_segments() -> set[str]:
    prefix = f"tierd-{os.getpid()}-"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def raw(t: Any) -> Any:
    """A tensor's bytes (any dtype, float8 included: torch.equal has no float8 kernel)."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "Tiered storage keeps hot files on fast disks.",
]


def embed(model: Any, tok: Any, device: str = "cpu") -> Any:
    """Sentence embeddings as sentence-transformers makes them: mean pooling, L2 norm."""
    import torch

    batch = tok(SENTENCES, padding=True, truncation=True, return_tensors="pt").to(device)
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


def run_child(code: str, args: Mapping[str, Any]) -> str:
    """Run ``code`` in a second Python process (a CUDA IPC handle cannot be opened by the
    process that made it, and the test's server runs in this one); returns its stdout."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "child ok" in done.stdout, done.stdout + done.stderr
    return done.stdout
