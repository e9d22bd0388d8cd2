"""A worker process of :mod:`._ranks`, as a serving engine runs one per rank: it asks a tierd
server over REST for its slices of a checkpoint and opens them by CUDA IPC.

Run as ``python -c WORKER_SRC ARGS_JSON``. It answers on stdout, one JSON line each: ``ready``
once warm, then for each ``go`` line on stdin ``loaded`` (every tensor a torch tensor on its
device, devices synchronised) and ``released`` (checked, first round only, and leases
released); on any failure an ``error`` line, and it exits.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["main"]

_PEEK = 32  # elements at the start of each slice compared with the file


def main(arg: str) -> None:
    """A serving engine's worker: load on each ``go`` line of stdin, answer on stdout."""
    args = json.loads(arg)
    # Replies go to a private copy of stdout, and fd 1 to stderr: nothing a library prints
    # (from Python or from C) can break the protocol.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(msg: Mapping[str, Any]) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    try:
        import torch

        from tierd_client import Client

        # cpu too (one rank: host memory is one device), so the protocol runs without GPUs.
        gpus = [d for d in args["devices"] if d.startswith("cuda")]
        for d in gpus:  # the CUDA contexts now, not in the first round
            torch.empty(1, device=d)
            torch.cuda.synchronize(d)
        with Client(args["url"], timeout=float(args["timeout_s"])) as api:
            api.request("GET", "/readyz")  # the connection, now
            reply({"ready": True})
            checked = False
            while sys.stdin.readline().strip() == "go":
                parts = api.load_safetensors(
                    args["files"], devices=args["devices"], sharding=args["spec"], rank=args["rank"]
                )
                try:
                    tensors = [p.torch() for p in parts]
                    for d in gpus:
                        torch.cuda.synchronize(d)
                    reply({"loaded": True})
                    if not checked:
                        _check(parts, tensors, args)
                        checked = True
                finally:
                    tensors = []  # the IPC mappings close: each round opens its own
                    for p in parts:
                        p.close()
                reply({"released": True})
    except BaseException as exc:
        traceback.print_exc()
        reply({"error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(1) from exc


def _check(parts: Sequence[Any], tensors: Sequence[Mapping[str, Any]], args: Any) -> None:
    """Each rank's tensors are ``torch.chunk``'s slices of the file's tensors, on its device,
    and start with the file's bytes at the slice's place."""
    import torch

    spec, layout, world = args["spec"], args["layout"], int(args["spec"]["world_size"])
    ranks = list(range(world)) if args["rank"] is None else [args["rank"]]
    if [p.rank for p in parts] != ranks or [p.device for p in parts] != args["devices"]:
        raise RuntimeError(f"got ranks {[(p.rank, p.device) for p in parts]}, not {ranks}")
    for p, ts, k in zip(parts, tensors, ranks, strict=True):
        if set(ts) != set(layout):
            raise RuntimeError(f"rank {k}: tensors {sorted(ts)}, not {sorted(layout)}")
        for name, (path, begin, full, itemsize) in layout.items():
            t = ts[name]
            rules = spec.get("rules", [])
            dim = next((r["dim"] for r in rules if fnmatch.fnmatchcase(name, r["pattern"])), None)
            shape, offset = list(full), [0] * len(full)
            if dim is not None:
                chunks = torch.empty(full, device="meta").chunk(world, dim)
                shape[dim] = chunks[k].shape[dim] if k < len(chunks) else 0
                offset[dim] = sum(c.shape[dim] for c in chunks[:k])
            got: list[Any] = [list(t.shape), list(p.full_shapes.get(name, full))]
            got += [list(p.slice_offsets.get(name, [0] * len(full))), str(t.device)]
            want = [shape, full, offset, str(torch.device(p.device))]
            if got != want:
                raise RuntimeError(f"rank {k} {name}: (shape, full, offset, device) {got}, {want}")
            count = math.prod(shape)
            if not count:
                continue
            # The slice's first elements lie together in the file: all of a dim-0 slice, one
            # row segment of a slice along a later dim.
            run = count if dim in (None, 0) else math.prod(shape[dim:])
            n = min(run, _PEEK)
            first = sum(o * math.prod(full[i + 1 :]) for i, o in enumerate(offset))
            with open(path, "rb") as f:
                expect = os.pread(f.fileno(), n * itemsize, begin + first * itemsize)
            have = t.reshape(-1)[:n].view(torch.uint8).cpu().numpy().tobytes()
            if have != expect:
                raise RuntimeError(f"rank {k} {name}: the first {n} elements differ from the file")
