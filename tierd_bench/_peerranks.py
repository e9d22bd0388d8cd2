"""A checkpoint loaded by one process per GPU, as serving engines run their ranks: tierd over
REST (each rank asking for its own slices, opened by CUDA IPC) or fastsafetensors (each rank
reading its share of the shards and exchanging tensors over NCCL), timed the same way.

Each rank is a process of its own (``python -c WORKER_SRC ARGS_JSON``) joined to the others
by ``torch.distributed`` (NCCL for fastsafetensors on GPUs, which needs it; gloo otherwise, as
tierd's ranks only meet at barriers). A round lasts from a barrier to the slowest rank's last
tensor, its device synchronised; one warm-up round, then ``repeats``. In every round each rank
checks its tensors against the files: a checksum of their bytes in name order, whole tensors
(``replicate``) or dim-0 slices (``tp``: blocks of ``ceil(rows / world)``, as ``torch.chunk``
and fastsafetensors' ``get_sharded`` cut them), computed here from the files beforehand. A
wrong round is counted and reported at the end, not raised at once, so that no rank is left
waiting in a barrier; a rank that fails ends the others.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tiering.checksum import Hasher

__all__ = ["SPECS", "expected_digests", "rank_main", "ranks"]

WORKER_SRC = "import sys; from tierd_bench._peerranks import rank_main; rank_main(sys.argv[1])"
#: One rank's whole run: its torch and NCCL start, and every round of a large checkpoint.
_TIMEOUT_S = 900.0
#: tierd's sharding spec of each mode: every tensor split along dim 0, or every tensor whole.
SPECS: dict[str, dict[str, Any]] = {
    "tp": {"rules": [{"pattern": "*", "dim": 0}]},
    "replicate": {"rules": []},
}


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        doc: dict[str, Any] = json.loads(f.read(n))
    doc.pop("__metadata__", None)
    return 8 + n, doc


def _rank_range(shape: Sequence[int], nbytes: int, world: int, rank: int) -> tuple[int, int]:
    """Byte range of rank ``rank``'s dim-0 slice of a tensor of ``shape`` (``nbytes``)."""
    rows = shape[0] if shape else 1
    row_bytes = nbytes // rows if rows else 0
    block = -(-rows // world)
    return min(rank * block, rows) * row_bytes, min((rank + 1) * block, rows) * row_bytes


def expected_digests(paths: Sequence[Path], world: int, mode: str) -> list[str]:
    """Per rank, the checksum of its tensors' bytes in name order, read from the files."""
    if mode not in SPECS:
        raise ValueError(f"mode must be one of {sorted(SPECS)}, got {mode!r}")
    where: dict[str, tuple[Path, int, list[int], int]] = {}
    for p in paths:
        base, doc = _header(p)
        for name, t in doc.items():
            lo, hi = t["data_offsets"]
            where[name] = (p, base + lo, list(t["shape"]), hi - lo)
    out: list[str] = []
    # Replicas all hold the same bytes: one pass over the files serves every rank.
    for rank in range(1 if mode == "replicate" else world):
        h = Hasher()
        for name in sorted(where):
            path, begin, shape, nbytes = where[name]
            lo, hi = (0, nbytes) if mode == "replicate" else _rank_range(shape, nbytes, world, rank)
            with open(path, "rb") as f:
                f.seek(begin + lo)
                left = hi - lo
                while left:
                    chunk = f.read(min(left, 64 << 20))
                    if not chunk:
                        raise RuntimeError(f"{path} ends inside tensor {name}")
                    h.update(chunk)
                    left -= len(chunk)
        out.append(h.value())
    return out * world if mode == "replicate" else out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ranks(
    loader: str,
    devices: Sequence[str],
    mode: str,
    repeats: int,
    digests: Sequence[str],
    source: Mapping[str, Any],
) -> tuple[float, set[str]]:
    """(median seconds of a round, the sources tierd's loads reported) of ``len(devices)``
    processes, rank ``k`` on ``devices[k]``, loading with ``loader``: ``fastsafetensors``
    (``source``: ``{"files": {rank: [paths]}}``) or ``tierd`` (``{"url": ..., "paths":
    [relpaths]}``). ``digests[k]`` is rank ``k``'s expected checksum.

    Raises RuntimeError with a rank's error if one fails; AssertionError if one loaded bytes
    other than the files'.
    """
    world = len(devices)
    if loader not in ("fastsafetensors", "tierd") or mode not in SPECS:
        raise ValueError(f"unknown loader {loader!r} or mode {mode!r}")
    if world < 2 or repeats < 1 or len(digests) != world:
        raise ValueError("at least 2 devices, 1 repeat and a digest per rank")
    # fastsafetensors' TP=2 and replicas as measured beside tierd: buffered (its O_DIRECT
    # default bypasses the hot page cache every other row reads).
    env = {**os.environ, "FASTSAFETENSORS_ODIRECT": "0"}
    with contextlib.ExitStack() as stack:
        port = _free_port()
        procs = []
        for k in range(world):
            args = {
                "loader": loader,
                "rank": k,
                "world": world,
                "port": port,
                "device": devices[k],
                "mode": mode,
                "repeats": repeats,
                "digest": digests[k],
                **source,
            }
            out = stack.enter_context(tempfile.TemporaryFile("w+"))
            cmd = [sys.executable, "-c", WORKER_SRC, json.dumps(args)]
            proc = subprocess.Popen(cmd, stdout=out, env=env, text=True)
            stack.callback(_end, proc)
            procs.append((proc, out))
        _wait_all([p for p, _ in procs])
        results = [_result(k, proc, out) for k, (proc, out) in enumerate(procs)]
    wrong = {k: r["wrong"] for k, r in enumerate(results) if r.get("wrong")}
    if wrong:
        raise AssertionError(f"{loader}: tensors differ from the files (rank: rounds) {wrong}")
    times = [r["times"] for r in results]
    if any(len(t) != repeats + 1 for t in times):
        raise RuntimeError(f"{loader} ranks gave {[len(t) for t in times]} rounds")
    rounds = [max(t[i] for t in times) for i in range(1, repeats + 1)]
    sources = {s for r in results for s in r.get("sources", [])}
    return statistics.median(rounds), sources


def _wait_all(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Until every rank has exited; once one fails, the others (waiting for it in a
    collective) are ended. Raises RuntimeError past the timeout."""
    deadline = time.monotonic() + _TIMEOUT_S
    while any(p.poll() is None for p in procs):
        failed = any(p.returncode not in (None, 0) for p in procs)
        late = time.monotonic() > deadline
        if failed or late:
            for p in procs:
                _end(p)
            if late:
                raise RuntimeError(f"ranks: no result in {_TIMEOUT_S:g} s")
            return
        time.sleep(0.05)


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _result(rank: int, proc: subprocess.Popen[str], out: Any) -> dict[str, Any]:
    out.seek(0)
    lines = [ln for ln in out.read().splitlines() if ln.startswith("{")]
    msg: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    if "error" in msg:
        raise RuntimeError(f"rank {rank}: {msg['error']}")
    if proc.returncode != 0 or "times" not in msg:
        raise RuntimeError(f"rank {rank} exited with {proc.returncode} (see its stderr)")
    return msg


def rank_main(arg: str) -> None:
    """One rank: every round, then one JSON line on stdout (``times`` and ``sources``, or
    ``error``)."""
    args = json.loads(arg)
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, not into the reply
    try:
        msg: dict[str, Any] = _rounds(args)
        code = 0
    except BaseException as exc:
        traceback.print_exc()
        msg, code = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}, 1
    proto.write(json.dumps(msg) + "\n")
    proto.flush()
    sys.stderr.flush()
    # Not through the interpreter's teardown: NCCL's can hang once a peer is gone.
    os._exit(code)


def _rounds(args: Mapping[str, Any]) -> dict[str, Any]:
    from . import _fastsafetensors as fst

    torch = importlib.import_module("torch")
    dist = importlib.import_module("torch.distributed")
    rank, world, device = int(args["rank"]), int(args["world"]), str(args["device"])
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # the CUDA context now, not in the first round
    nccl = cuda and args["loader"] == "fastsafetensors"
    dist.init_process_group(
        "nccl" if nccl else "gloo",
        init_method=f"tcp://127.0.0.1:{int(args['port'])}",
        rank=rank,
        world_size=world,
    )
    barrier: dict[str, Any] = {"device_ids": [torch.device(device).index]} if nccl else {}
    sources: set[str] = set()
    with contextlib.ExitStack() as stack:
        if args["loader"] == "tierd":
            from tierd_client import Client

            api = stack.enter_context(Client(args["url"], timeout=_TIMEOUT_S))
            spec = {"world_size": world, **SPECS[args["mode"]]}

            def load() -> fst.Loaded:
                parts = api.load_safetensors(
                    args["paths"], devices=[device], sharding=spec, rank=rank
                )
                sources.update(str(b.source) for p in parts for b in p.buffers)
                tensors = parts[0].torch()

                def close() -> None:
                    tensors.clear()
                    for p in parts:
                        p.close()

                return tensors, close
        else:
            files = {int(k): v for k, v in args["files"].items()}

            def load() -> fst.Loaded:
                return fst.rank_tensors(dist.group.WORLD, device, files, args["mode"])

        times: list[float] = []
        wrong = 0
        for _ in range(int(args["repeats"]) + 1):
            dist.barrier(**barrier)
            t0 = time.perf_counter()
            tensors, close = load()
            try:
                if cuda:
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
                wrong += _digest(tensors) != args["digest"]
            finally:
                close()
        dist.barrier(**barrier)
    # No destroy_process_group: rank_main ends the process with os._exit, teardown and all.
    return {"times": times, "sources": sorted(sources), "wrong": wrong}


def _digest(tensors: Mapping[str, Any]) -> str:
    from ._fastsafetensors import torch_bytes

    h = Hasher()
    for name in sorted(tensors):
        h.update(torch_bytes(tensors[name]).data)
    return h.value()
