"""``tierd bench fleet``: a model onto every host of a fleet, by one fleet job against the same
prefetch started by hand on each host.

One run starts a PostgreSQL catalog (a throwaway server, or a scratch database on
``--catalog-url``), an S3 origin (:func:`._origin.open_origin`) and ``hosts`` tierd servers,
each in its own process (:func:`.rest.server_process`) with its own host id and data directory:
a directory tier ``nvme`` of its own above the shared bucket tier ``s3``. Then, ``runs`` times,
each measure on a model of its own (``shards`` safetensors files of random bytes, ``size`` in
all, put into the origin under a fresh prefix and adopted by one scan, untimed), so that every
measure starts cold:

- **by hand**: ``POST /v1/prefetch`` (target ``nvme``) of the model's files to every host at
  once, one thread each; from the first request until the last host's job is done;
- **fleet**: one ``POST /v1/fleet/prefetch`` ``{model, hosts: "all", target: nvme}`` to the
  first host; from the request until the fleet job is done;
- **one host**: ``POST /v1/prefetch`` to the first host alone: what one host gets from the
  origin, so that the reader sees how the hosts share it.

By hand and fleet alternate which goes first. Both are followed the same way, by polling
every 20 ms from this process. The fleet's figure includes what it costs by design: each host
finds its task at its next poll (``fleet_poll_interval_s``, given beside the figures) and
reports its end at its next progress write. After each measure every host's copy of every file
is checked (its size, its first and last 4 KiB on disk and through ``GET content`` with a
Range); a wrong or missing byte stops the bench. Starting and stopping the fleet is
:mod:`._fleethosts`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiering.serving.fleetjobs import FleetWorkerConfig
from tiering.tiers.paths import COMPRESSED_DIR, RESERVED_DIR

from ._datafiles import workdir
from ._fleethosts import (
    Fleet,
    FleetBenchFailed,
    FleetBenchUnavailable,
    Host,
    catalog_database,
    forget_model,
    started,
)
from ._measure import MiB, format_size
from ._origin import OriginUnavailable, open_origin
from ._postgres import NoScratchDatabase, require_postgresql
from ._report import BenchRow, Report
from .rest import follow_job

__all__ = ["FleetBenchFailed", "FleetBenchUnavailable", "run"]

#: How often this process asks whether a job is done (by hand and fleet alike).
POLL_S = 0.02
#: Bytes compared at each end of every copy.
SAMPLE = 4096
#: The smallest shard: room for a header and two distinct samples.
MIN_SHARD = 4 * SAMPLE
_JOB_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class _Shard:
    path: str  # relpath on the s3 tier
    size: int
    head: bytes
    tail: bytes


# -- the model ----------------------------------------------------------------------------------
def _write_shard(path: Path, nbytes: int, rng: np.random.Generator) -> _Shard:
    """A safetensors file of ``nbytes``: one U8 tensor of random bytes after a valid header."""
    head_len = 0
    while True:  # the header's length depends on the tensor's, which depends on it
        n = nbytes - 8 - head_len
        meta = {"weight": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}
        raw = json.dumps(meta, separators=(",", ":")).encode()
        if len(raw) <= head_len:
            break
        head_len = -(-len(raw) // 8) * 8  # padded to 8 bytes, as safetensors writes it
    raw = raw.ljust(head_len, b" ")
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        done = 0
        while done < n:
            chunk = rng.bytes(min(16 * MiB, n - done))
            f.write(chunk)
            done += len(chunk)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(SAMPLE)
        f.seek(size - SAMPLE)
        tail = f.read(SAMPLE)
    return _Shard("", size, head, tail)


def _write_compressed(path: Path, nbytes: int, seed: int) -> tuple[_Shard, bool]:
    """A bf16 safetensors file of about ``nbytes`` (its logical bytes described), written at
    ``path`` as tierd's object tier stores it: a container (:mod:`tiering.codec`), or as it
    is where that would not pay (a small file); and whether it is a container."""
    from tiering.codec import encode_bytes

    from .codec import synthetic_bf16

    data = synthetic_bf16(nbytes, seed=seed, tensors=2)
    stored = encode_bytes(data)
    path.write_bytes(stored)
    return _Shard("", len(data), data[:SAMPLE], data[-SAMPLE:]), stored != data


def _new_model(fleet: Fleet, tag: str, size: int, shards: int) -> list[_Shard]:
    """A model of its own under ``tag/``: written, put into the origin, adopted by one scan on
    the first host (the bucket tier is shared: every host sees the records). With
    ``fleet.compressed``, bf16 weights put where the object tier keeps what it compressed."""
    seed = int.from_bytes(secrets.token_bytes(8), "little")
    rng = np.random.default_rng(seed)
    local = fleet.work / "model"
    local.mkdir(exist_ok=True)
    out = []
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        per = size // shards + (size % shards if s == shards - 1 else 0)
        packed = False
        if fleet.compressed:
            shard, packed = _write_compressed(local / name, per, seed + s)
        else:
            shard = _write_shard(local / name, per, rng)
        where = f"{COMPRESSED_DIR}/{tag}" if packed else tag
        key = f"{fleet.prefix}/{where}/{name}"
        fleet.origin.put_file(key, local / name)
        (local / name).unlink()  # the origin has it (nginx: a hard link to the same inode)
        out.append(_Shard(f"{tag}/{name}", shard.size, shard.head, shard.tail))
    first = fleet.hosts[0]
    first.ok(first.http.post("/v1/scan"))
    for shard in out:
        rec = first.ok(first.http.get("/v1/files/lookup", params={"path": shard.path}))
        if rec["tier"] != "s3" or rec["size"] != shard.size:
            raise FleetBenchFailed(f"{shard.path} was adopted as {rec}, not on s3 at its size")
    return out


# -- the measures -------------------------------------------------------------------------------
def _by_hand(hosts: list[Host], paths: list[str]) -> float:
    """Seconds from the first ``POST /v1/prefetch`` (all sent at once) to the last job done."""
    start = threading.Barrier(len(hosts) + 1)
    ends: list[float] = [0.0] * len(hosts)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        h = hosts[i]
        try:
            start.wait()
            body = {"paths": paths, "target": "nvme"}
            job = h.ok(h.http.post("/v1/prefetch", json=body), want=202)
            job = _follow(h, f"/v1/jobs/{job['id']}", job)
            ends[i] = time.monotonic()
            if job["state"] != "done" or job["errors"] or job["files_done"] != len(paths):
                raise FleetBenchFailed(f"host {h.host_id}: prefetch job ended {job}")
        except BaseException as exc:  # re-raised below: a failed host must not read as fast
            errors.append(exc)

    threads = [
        threading.Thread(target=one, args=(i,), name=f"bench-hand-{i}") for i in range(len(hosts))
    ]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return max(ends) - t0


def _fleet(hosts: list[Host], model: str, nfiles: int) -> float:
    """Seconds from one ``POST /v1/fleet/prefetch`` to the fleet job done on every host."""
    h = hosts[0]
    body = {"model": model, "hosts": "all", "target": "nvme"}
    t0 = time.monotonic()
    job = h.ok(h.http.post("/v1/fleet/prefetch", json=body), want=202)
    job = _follow(h, f"/v1/fleet/jobs/{job['id']}", job)
    elapsed = time.monotonic() - t0
    on = sorted(t["host"] for t in job["hosts"])
    if job["state"] != "done" or job["files_done"] != nfiles * len(hosts):
        raise FleetBenchFailed(f"fleet job {job['id']} ended {job['state']}: {job}")
    if on != sorted(x.host_id for x in hosts):
        raise FleetBenchFailed(f"fleet job {job['id']} ran on {on}, not on every host")
    return elapsed


def _follow(h: Host, url: str, job: dict[str, Any]) -> dict[str, Any]:
    return follow_job(
        job,
        lambda: h.ok(h.http.get(url)),
        poll_s=POLL_S,
        timeout_s=_JOB_TIMEOUT_S,
        late=lambda j: FleetBenchFailed(
            f"host {h.host_id}: {url} still {j['state']} after an hour"
        ),
    )


def _check(fleet: Fleet, hosts: list[Host], model: list[_Shard]) -> None:
    """Every host in ``hosts`` holds its own copy of every shard, right at both ends, and
    serves those bytes; else :class:`FleetBenchFailed`."""
    for h in hosts:
        for shard in model:
            rec = h.ok(h.http.get("/v1/files/lookup", params={"path": shard.path}))
            copy = h.root / "nvme" / RESERVED_DIR / f"{rec['id']}.{rec['generation']}"
            where = f"host {h.host_id}: {shard.path}"
            try:
                with copy.open("rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    head = f.read(SAMPLE)
                    f.seek(max(0, size - SAMPLE))
                    tail = f.read(SAMPLE)
            except FileNotFoundError:
                raise FleetBenchFailed(f"{where}: no copy on its nvme ({copy})") from None
            if (size, head, tail) != (shard.size, shard.head, shard.tail):
                raise FleetBenchFailed(f"{where}: the copy's bytes differ from the origin's")
            last = f"bytes={shard.size - SAMPLE}-{shard.size - 1}"
            for rng, want in ((f"bytes=0-{SAMPLE - 1}", shard.head), (last, shard.tail)):
                r = h.http.get(f"/v1/files/{rec['id']}/content", headers={"Range": rng})
                if r.status_code != 206 or r.content != want:
                    raise FleetBenchFailed(f"{where}: GET content {rng} gave wrong bytes")
            fleet.checked["copies"] += 1
            fleet.checked["bytes_compared"] += 4 * SAMPLE
    fleet.checked["measures"] += 1


# -- the run ------------------------------------------------------------------------------------
def check_model(size: int, shards: int) -> None:
    """Refuse a model of no shards, or one too small for ``shards`` (``ValueError``)."""
    if shards < 1:
        raise ValueError("hosts, runs and shards must be at least 1")
    if size < shards * MIN_SHARD:
        raise ValueError(
            f"size must be at least {format_size(shards * MIN_SHARD)} ({shards} shards)"
        )


def _check_options(poll_interval: float | None, catalog_url: str | None) -> None:
    if poll_interval is not None and poll_interval <= 0:
        raise ValueError("poll_interval must be positive")
    require_postgresql(catalog_url, FleetBenchUnavailable)


def run(
    size: int = 256 * MiB,
    shards: int = 4,
    hosts: int = 3,
    runs: int = 3,
    origin: str = "moto",
    *,
    rate: int | None = 100_000_000,
    poll_interval: float | None = None,
    catalog_url: str | None = None,
    directory: Path | None = None,
    compressed: bool = False,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Measure a fleet prefetch against prefetches by hand (see the module docstring).

    Parameters
    ----------
    size, shards
        The model: ``shards`` safetensors files of ``size`` bytes in all.
    hosts, runs
        tierd servers started; timed runs per figure (medians).
    origin, rate
        The S3 origin (``moto``, ``s3like``, ``open`` or a URL) and the s3like cap, bytes/s.
    poll_interval
        The hosts' ``fleet_poll_interval_s`` (None: the setting's default).
    catalog_url
        ``postgresql+psycopg://...`` of a server to run on, in a scratch database it creates
        and drops (needs CREATEDB); default a throwaway local PostgreSQL.
    directory
        Where the hosts' data directories go (default: the current directory; not tmpfs).

    Raises
    ------
    FleetBenchUnavailable
        No PostgreSQL, a ``catalog_url`` that is not PostgreSQL or takes no scratch database,
        or an origin that cannot be started.
    FleetBenchFailed
        A job failed, or a host's copy is missing or wrong.
    """
    if hosts < 1 or runs < 1:
        raise ValueError("hosts, runs and shards must be at least 1")
    check_model(size, shards)
    _check_options(poll_interval, catalog_url)
    poll = poll_interval or FleetWorkerConfig().poll_interval_s
    times: dict[str, list[float]] = {"hand": [], "fleet": [], "single": []}
    try:
        with contextlib.ExitStack() as stack:
            work = stack.enter_context(workdir(directory))
            pg_url, server = stack.enter_context(catalog_database(catalog_url, say))
            org = stack.enter_context(open_origin(origin, rate=rate, parent=work, say=say))
            fleet = stack.enter_context(started(org, pg_url, work, hosts, poll, say))
            fleet.compressed = compressed
            _measure(fleet, size, shards, runs, times, say)
            desc = org.description
    except (NoScratchDatabase, OriginUnavailable) as exc:
        raise FleetBenchUnavailable(str(exc)) from exc
    setup = {
        "hosts": hosts,
        "shards": shards,
        "size_bytes": size,
        "runs": runs,
        "compressed": compressed,
        "origin": origin,
        "origin_description": desc,
        "postgresql": server,
        "poll_interval_s": poll,
        "progress_interval_s": FleetWorkerConfig().progress_interval_s,
        "client_poll_s": POLL_S,
        "seconds": times,
        "checked": fleet.checked,
    }
    return _report(setup, times)


def _measure(
    fleet: Fleet,
    size: int,
    shards: int,
    runs: int,
    times: dict[str, list[float]],
    say: Callable[[str], None],
) -> None:
    n = len(fleet.hosts)
    # Untimed: each host's first prefetch opens its connections to the origin and warms its
    # code paths; the first timed measure must not pay for that alone.
    say("warm-up: a one-shard model by hand on every host (untimed)")
    warm = _new_model(fleet, "warm-up", MIN_SHARD, 1)
    _by_hand(fleet.hosts, [s.path for s in warm])
    _check(fleet, fleet.hosts, warm)
    forget_model(fleet, "warm-up")
    for r in range(runs):
        # Alternate which goes first, so neither always meets a warmer origin.
        order = ["hand", "fleet"] if r % 2 == 0 else ["fleet", "hand"]
        for what in [*order, "single"]:
            tag = f"r{r + 1}-{what}"
            say(f"run {r + 1} of {runs}: {what}, a new model of {format_size(size)}")
            model = _new_model(fleet, tag, size, shards)
            paths = [s.path for s in model]
            if what == "hand":
                times[what].append(_by_hand(fleet.hosts, paths))
            elif what == "fleet":
                times[what].append(_fleet(fleet.hosts, tag, len(paths)))
            else:
                times[what].append(_by_hand(fleet.hosts[:1], paths))
            _check(fleet, fleet.hosts if what != "single" else fleet.hosts[:1], model)
            # The origin's copy is not needed again: give back moto's memory (or disk).
            forget_model(fleet, tag)
            on = n if what != "single" else 1
            say(f"  {times[what][-1]:.3f} s; the bytes checked on {on} host(s)")


def _report(setup: dict[str, Any], times: dict[str, list[float]]) -> Report:
    n, size, poll = setup["hosts"], setup["size_bytes"], setup["poll_interval_s"]
    report = Report(
        "fleet",
        f"tierd bench fleet: {n} hosts, a model of {setup['shards']} shards, "
        f"{format_size(size)}, origin {setup['origin']}, fleet poll interval {poll:g} s, "
        f"medians of {setup['runs']}",
        setup,
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    report.add(
        BenchRow(
            "hand_s", f"by hand: {n} POST /v1/prefetch at once, until all done", med["hand"], "s"
        )
    )
    row = report.add(
        BenchRow(
            "fleet_s",
            f"fleet: one POST /v1/fleet/prefetch to {n} hosts, until done",
            med["fleet"],
            "s",
            note=(
                "hosts are woken by the job's commit (LISTEN/NOTIFY; a poll every "
                f"{poll:g} s is the fallback) and write progress as they go"
            ),
        )
    )
    report.compare(row.key, "hand_s")
    report.add(
        BenchRow(
            "fleet_extra_s",
            "fleet's extra over by hand",
            med["fleet"] - med["hand"],
            "s",
            note=(
                f"the claim, the progress writes and the job's polling by the client "
                f"(poll interval {poll:g} s, progress interval "
                f"{setup['progress_interval_s']:g} s)"
            ),
        )
    )
    report.add(BenchRow("single_s", "one host: POST /v1/prefetch, until done", med["single"], "s"))
    report.add(
        BenchRow("hand_gbps", f"by hand, {n} hosts' bytes", n * size / med["hand"] / 1e9, "GB/s")
    )
    report.add(
        BenchRow("fleet_gbps", f"fleet, {n} hosts' bytes", n * size / med["fleet"] / 1e9, "GB/s")
    )
    report.compare("fleet_gbps", "hand_gbps")
    report.add(BenchRow("single_gbps", "one host", size / med["single"] / 1e9, "GB/s"))
    report.compare("hand_gbps", "single_gbps")
    hand = report.rows["hand_gbps"]
    if hand.ratio is not None:
        hand.note = f"{n}x one host's rate if the origin is not the limit"
    return report
