"""Issue 12's "each rank asking for itself (2 processes)" row of ``tierd bench multi-gpu``, for
real: serving engines run one worker process per rank, and each asks the tierd service over
REST for its own slices and opens them by CUDA IPC.

One tierd server (its own process) serves hard links to the bench's shard files. Worker
processes, started once and kept warm (imports, CUDA contexts, the client's connection), each
load on a ``go`` line: one worker asking for every rank in one request, against ``world_size``
workers each asking for its rank, all started by the same ``go``. A round is timed from ``go``
to every worker's reply, which comes once every tensor is a torch tensor on its device and the
devices are synchronised; checking (first round) and releasing the leases come after, untimed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .rest import server_process

__all__ = ["per_rank_processes"]

#: What a worker process runs: :func:`._rankworker.main`, typed and linted, not code in a string.
WORKER_SRC = "import sys; from tierd_bench._rankworker import main; main(sys.argv[1])"
_TIMEOUT_S = 600.0  # one reply: a cold worker's torch import, or a load of a large checkpoint
# Above the checkpoint's bytes: each tensor is aligned in its buffer, and each buffer is
# allocated in 2 MiB granules.
_BUDGET_SLACK = 256 << 20


def per_rank_processes(
    files: Sequence[Path],
    spec: Mapping[str, Any],
    devices: Sequence[str],
    repeats: int,
    say: Callable[[str], None],
) -> tuple[float, float]:
    """(median seconds of one request loading every rank, median seconds of world_size worker
    processes each loading its own rank at the same time), both through one tierd server.

    Rank ``k`` goes to ``devices[k]``. One warm-up round (which also checks every slice's
    shape, place and first bytes), then ``repeats`` rounds, the two ways taking turns so
    neither gets a warmer host. Raises RuntimeError with a worker's error if one fails.
    """
    world = int(spec["world_size"])
    if repeats < 1 or len(devices) != world:
        raise ValueError("repeats must be at least 1, and devices one per rank of the spec")
    with tempfile.TemporaryDirectory(prefix="tierd-ranks-") as tmp:
        data = Path(tmp) / "data"
        rels = _place(files, data / "nvme", say)  # nvme: the fastest of the default tiers
        layout = _layout(data / "nvme", rels)
        budget = sum(p.stat().st_size for p in files) + _BUDGET_SLACK
        say(f"starting tierd and {world + 1} worker processes on {len(rels)} shards")
        env = {"TIERD_BUFFERS__GPU_BUDGET_BYTES": str(budget)}  # a whole checkpoint per GPU
        with server_process(data, env=env, timeout=_TIMEOUT_S) as (url, _):
            _hold_still(url)
            common = {
                "url": url,
                "files": rels,
                "spec": dict(spec),
                "layout": layout,
                "timeout_s": _TIMEOUT_S,
            }
            with contextlib.ExitStack() as stack:
                one = _Worker("one request", {**common, "devices": list(devices), "rank": None})
                stack.enter_context(one)
                ranks = []
                for k in range(world):
                    w = _Worker(f"rank {k}", {**common, "devices": [devices[k]], "rank": k})
                    ranks.append(stack.enter_context(w))
                for w in [one, *ranks]:
                    w.reply()  # ready: imported, CUDA contexts made, connected
                say(f"one request for {world} ranks against {world} processes, {repeats} times")
                t_one: list[float] = []
                t_ranks: list[float] = []
                for i in range(repeats + 1):
                    a, b = _round([one]), _round(ranks)
                    if i:
                        t_one.append(a)
                        t_ranks.append(b)
    return statistics.median(t_one), statistics.median(t_ranks)


def _place(files: Sequence[Path], root: Path, say: Callable[[str], None]) -> list[str]:
    """Hard-link each shard under ``root`` (the page cache the bench warmed is the same
    inode's); copy where linking fails (another filesystem). Returns their relpaths."""
    rels: list[str] = []
    copied = 0
    for i, src in enumerate(files):
        rel = f"ranks/{i}-{src.name}"  # the index keeps shards of the same name apart
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
            copied += 1
        rels.append(rel)
    if copied:
        say(f"{copied} shard(s) copied, not linked: the temp dir is on another filesystem")
    return rels


def _layout(root: Path, rels: Sequence[str]) -> dict[str, list[Any]]:
    """``{name: [path, first data byte, full shape, itemsize]}`` from the safetensors headers,
    read here so the workers check the server's replies against the files, not themselves."""
    out: dict[str, list[Any]] = {}
    for rel in rels:
        path = root / rel
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            if name in out:
                raise ValueError(f"tensor {name!r} is in more than one shard")
            start, stop = t["data_offsets"]
            count = math.prod(t["shape"])
            out[name] = [str(path), 8 + n + start, t["shape"], (stop - start) // max(count, 1)]
    return out


def _hold_still(url: str) -> None:
    """Turn the scheduler off: the shards are cold and soon past the policy's minimum age, so
    it would demote them to a slower tier in the middle of the measure."""
    from tierd_client import Client

    with Client(url) as api:
        doc = api.policy()["policy"]
        api.request("PUT", "/v1/policy", json={**doc, "enabled": False})


def _round(workers: Sequence[_Worker]) -> float:
    """Seconds from ``go`` to every worker's ``loaded``; then each checks (its first round
    only) and releases its leases, untimed, before it answers again."""
    t0 = time.perf_counter()
    for w in workers:
        w.send("go")
    for w in workers:
        w.reply()
    dt = time.perf_counter() - t0
    for w in workers:
        w.reply()
    return dt


class _Worker:
    """One worker process; a context manager that always ends it."""

    def __init__(self, name: str, args: Mapping[str, Any]) -> None:
        self.name = name
        cmd = [sys.executable, "-c", WORKER_SRC, json.dumps(args)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdin is None or self.proc.stdout is None:
            raise RuntimeError("no pipes to the worker")
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        self._lines: queue.Queue[str | None] = queue.Queue()
        # Read on a thread: a worker that hangs is then a timeout here, and one that dies an
        # EOF, rather than the coordinator blocked in readline for ever.
        self._reader = threading.Thread(target=self._read, name=f"ranks-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, line: str) -> None:
        try:
            self._stdin.write(line + "\n")
            self._stdin.flush()
        except OSError as exc:
            raise RuntimeError(f"{self.name} worker is gone (exit {self.proc.poll()})") from exc

    def reply(self) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(f"{self.name} worker: no reply in {_TIMEOUT_S:g} s") from None
        if line is None:
            code = self.proc.wait()
            raise RuntimeError(f"{self.name} worker exited with {code} (see its stderr)")
        msg: dict[str, Any] = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"{self.name} worker: {msg['error']}")
        return msg

    def __enter__(self) -> _Worker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is not None:
            self.proc.kill()  # it may be stuck in a load: don't wait for it
        with contextlib.suppress(OSError):
            self._stdin.close()  # EOF: a healthy worker's loop ends
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join()
