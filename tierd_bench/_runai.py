"""Run:ai Model Streamer as a load peer: a safetensors object → torch tensors on each device.

The streamer reads safetensors, so the bench puts a variant of the object beside it:
``<prefix>/model.safetensors``, one bf16 tensor whose bytes are the object's (a header, then
the same bytes), and checks the tensor's bytes against the source. The streamer's S3 client
(AWS CRT) is pointed at the origin through the environment it documents (``AWS_ENDPOINT_URL``,
``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0``), set only while it runs. Its concurrency
(``RUNAI_STREAMER_CONCURRENCY``) is swept like boto3's TransferConfig: its default, 16 and the
run's connections, each once, then the best one's median (``load_runai_<dev>``). On the H100
its default beat 64 (issue 17): one fixed setting would not be fair to it.

Optional: without ``runai-model-streamer`` and ``runai-model-streamer-s3`` (and torch) the row
says "not installed".
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

from ._measure import free_gpu, gbps
from ._objrun import ObjRun, checksum_of_array
from ._report import BenchRow

__all__ = ["runai_loads"]

_INSTALL = "not installed (pip install runai-model-streamer runai-model-streamer-s3)"
_KEY = "model.safetensors"


def runai_loads(run: ObjRun, devices: list[str]) -> None:
    """``load_runai_<dev>`` for each of ``devices``."""
    # Looked up before anything is imported: torch alone takes a second or more to import.
    names = ("runai_model_streamer", "runai_model_streamer_s3", "torch")
    absent = [n for n in names if importlib.util.find_spec(n) is None]
    try:
        for name in names if not absent else ():
            importlib.import_module(name)
    except ImportError as exc:
        absent = [f"{name}: {exc}"]
    if absent:
        for device in devices:
            on = run.on(device)
            why = f"{_INSTALL}; missing {', '.join(absent)}"
            on.missing(f"load_runai_{on.dev}", _label(on, None), why)
        return
    if run.size % 2:
        for device in devices:
            on = run.on(device)
            on.missing(f"load_runai_{on.dev}", _label(on, None), "needs an even size (bf16)")
        return
    key = f"{run.prefix}/{_KEY}"
    path = run.work / _KEY
    _write_safetensors(run, path)
    try:
        run.origin.put_file(key, path)
        for device in devices:
            _runai_load(run.on(device), key)
            free_gpu()
    finally:
        path.unlink(missing_ok=True)


def _label(run: ObjRun, concurrency: int | None) -> str:
    conc = "default" if concurrency is None else str(concurrency)
    return (
        f"Run:ai Model Streamer, safetensors -> torch on {run.device} "
        f"(concurrency {conc}, best of a sweep)"
    )


def _write_safetensors(run: ObjRun, path: Any) -> None:
    """The source's bytes as one bf16 tensor: an 8-byte header length, the JSON header
    (padded with spaces to 8 bytes, as safetensors writes it), then the data."""
    header = {"weight": {"dtype": "BF16", "shape": [run.size // 2], "data_offsets": [0, run.size]}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out, open(run.source, "rb") as src:
        out.write(len(text).to_bytes(8, "little") + text)
        shutil.copyfileobj(src, out, 16 << 20)
        out.flush()
        os.fsync(out.fileno())


@contextlib.contextmanager
def _environment(run: ObjRun, concurrency: int | None) -> Iterator[None]:
    env = {
        "AWS_ENDPOINT_URL": run.origin.endpoint,
        "RUNAI_STREAMER_S3_ENDPOINT": run.origin.endpoint,
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
        "AWS_EC2_METADATA_DISABLED": "true",
        "RUNAI_STREAMER_LOG_LEVEL": "WARNING",
    }
    if concurrency is not None:
        env["RUNAI_STREAMER_CONCURRENCY"] = str(concurrency)
    saved = {k: os.environ.get(k) for k in [*env, "RUNAI_STREAMER_CONCURRENCY"]}
    os.environ.pop("RUNAI_STREAMER_CONCURRENCY", None)
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _runai_load(run: ObjRun, key: str) -> None:
    streamer = importlib.import_module("runai_model_streamer")
    torch = importlib.import_module("torch")
    url = f"s3://{run.origin.bucket}/{key}"

    def load() -> list[Any]:
        with streamer.SafetensorsStreamer() as s:
            s.stream_file(url)
            return [t.to(run.device) for _, t in s.get_tensors()]

    def check(tensors: list[Any]) -> None:
        if len(tensors) != 1:
            raise RuntimeError(f"Run:ai gave {len(tensors)} tensors, not 1")
        data = tensors[0].view(torch.uint8).cpu().numpy()
        tensors.clear()
        run.check("Run:ai Model Streamer", checksum_of_array(data))

    dev = run.dev
    single: dict[int | None, float] = {}
    for i, conc in enumerate(dict.fromkeys((None, 16, run.conns))):
        try:
            with _environment(run, conc):
                single[conc], _ = run.timed(load, check, repeats=1, warmup=1 if i == 0 else 0)
        except AssertionError:
            raise
        except Exception as exc:  # a streamer that cannot reach this origin says so
            run.missing(
                f"load_runai_{dev}",
                _label(run, conc),
                f"failed: {type(exc).__name__}: {str(exc)[:300]}",
            )
            return
        name = "default" if conc is None else str(conc)
        run.add(
            BenchRow(
                f"load_runai_{dev}_{name}",
                f"  Run:ai concurrency {name} -> {dev}",
                gbps(run.size, single[conc]),
                "GB/s",
                note="(one run)",
            )
        )
    best = min(single, key=lambda c: single[c])
    with _environment(run, best):
        t, cpu = run.timed(load, check, warmup=0)
    run.rate_row(f"load_runai_{dev}", _label(run, best), t, cpu)
