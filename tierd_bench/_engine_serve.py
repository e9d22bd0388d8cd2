"""tierd's rows of ``tierd bench engine``: one server, its rows in the order the state they
need builds up (see :mod:`.engine`).

The page cache first; then the files prefetched into the memory tier, and the memory-tier
rows (one GPU, then one process per GPU on a host with two); the restart last, since its
first ``shared=true`` start leaves a copy kept on the GPU, which every later load of those
files may be served from.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ._engine_rows import Engine, Measured, repeat
from ._measure import GiB
from .rest import server_process

__all__ = ["rows", "server"]


@contextmanager
def server(tmp: Path, nbytes: int) -> Iterator[str]:
    """A tierd server on ``tmp / "nvme"`` with a memory tier the model fits in, its scheduler
    off (nothing moves mid-run); yields its URL."""
    from ._ranks import _hold_still

    tiers = [
        {"name": "ram", "kind": "memory", "quota_bytes": nbytes + GiB},
        {"name": "nvme", "path": str(tmp / "nvme")},
    ]
    env = {
        "TIERD_TIERS": json.dumps(tiers),
        # A restart's kept copy, a plain load's own copy and a margin.
        "TIERD_BUFFERS__GPU_BUDGET_BYTES": str(3 * nbytes + GiB),
        "TIERD_LOG_LEVEL": "warning",
    }
    with server_process(tmp / "data", env=env) as (url, _pid):
        _hold_still(url)
        yield url


def rows(
    engine: Engine,
    url: str,
    name: str,
    wanted: Sequence[str],
    repeats: int,
    say: Callable[[str], None],
) -> list[Measured]:
    """tierd's rows among ``wanted`` (``tierd``, ``replicas``, ``restart``)."""
    from tierd_client import Client

    def tierd(shared: bool = False, device: str | None = None) -> dict[str, Any]:
        return engine.args("tierd", device, url=url, name=name, shared=shared)

    def row(m: Measured, procs: Callable[[], list[dict[str, Any]]], n: int = repeats) -> None:
        out.append(repeat(engine, m, procs, n, say, url=url))

    out: list[Measured] = []
    if "tierd" in wanted:
        row(Measured("page_cache", "tierd REST load_state_dict, page cache"), lambda: [tierd()])
    with Client(url, timeout=600) as api:
        say("prefetching the model into the memory tier")
        shards = [f"{name}/{f.name}" for f in engine.files]
        api.prefetch(shards, target="memory", wait=True, progress=False, timeout=600)
    if "tierd" in wanted:
        row(Measured("memory", "tierd REST load_state_dict, memory tier"), lambda: [tierd()])
    if "replicas" in wanted:
        out += _replicas(engine, tierd, repeats, say, url)
    if "restart" in wanted:
        first = Measured("first_start", "tierd, a first start with shared=true (memory tier)")
        row(first, lambda: [tierd(shared=True)], 1)
        shared = Measured("restart", "tierd, a restart: shared=true, handed the kept copy")
        row(shared, lambda: [tierd(shared=True)])
        plain = Measured("restart_plain", "tierd, a restart: a plain load_state_dict")
        row(plain, lambda: [tierd()])
    return out


def _replicas(
    engine: Engine,
    tierd: Callable[..., dict[str, Any]],
    repeats: int,
    say: Callable[[str], None],
    url: str,
) -> list[Measured]:
    """One process per GPU, started together, each loading a whole replica."""
    from . import _fastsafetensors as fst
    from ._modelpeers import two_gpus

    tierd_m = Measured("replicas_memory", "2 GPUs, a process each: tierd replicas, memory tier")
    fst_m = Measured("replicas_fst", "2 GPUs, a process each: fastsafetensors replicas")
    tp = Measured("tp2", "2 GPUs, a process each: TP=2")
    tp.note = (
        "not measured: a TP=2 forward needs a tensor-parallel model (vLLM's), which "
        "transformers' meta-built model is not; tierd bench models measures per-rank TP loads"
    )
    gpus = two_gpus(engine.device)
    if gpus is None:
        why = "needs two GPUs (one process per GPU)"
        for m in (tierd_m, fst_m, tp):
            m.note = why
        return [tierd_m, fst_m, tp]
    say("untimed: the server's first load into each GPU")
    engine.together([tierd(device=g) for g in gpus])
    tierd_m = repeat(
        engine, tierd_m, lambda: [tierd(device=g) for g in gpus], repeats, say, url=url
    )
    missing = fst.missing()
    if missing is None:
        fst_m.note = "each process reads every shard (no NCCL broadcast)"
        procs = [engine.args("fastsafetensors", g) for g in gpus]
        fst_m = repeat(engine, fst_m, lambda: procs, repeats, say)
    else:
        fst_m.note = missing
    return [tierd_m, fst_m, tp]
