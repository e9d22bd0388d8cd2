"""``tierd bench fleet --network``: how long a fleet takes to warm a model, and how many bytes
the origin sends for it, with 1, 4 and 8 hosts (``counts``), in one run.

With root, ``ip`` and ``tc`` (:mod:`._netns`), the origin (nginx) and every host are each in a
network namespace of their own on one bridge; the origin's link sends at ``origin_bps`` (its
egress cap) and each host's link runs at ``host_bps``. Without them the bench says why and runs
the same measures on loopback, unshaped. The catalog is a PostgreSQL server in this namespace
(reached over its Unix socket) or ``catalog_url``.

For each count ``n`` (``runs`` times, medians), a model of its own (``shards`` safetensors
files, ``size`` in all, cold everywhere) is warmed by one ``POST /v1/fleet/prefetch`` to the
first ``n`` hosts (target ``nvme``), timed from the request to the job done; then every copy's
bytes are checked (:func:`.fleet._check`). The origin's bytes for that model are read from the
origin's own access log (nginx's ``$bytes_sent``, headers included), not from tierd's counters.

Reported per count: the warm time, its ratio to one host's and to the origin-cap ceiling (the
model's bytes at the origin's rate: what a fleet that read the bucket once could reach), the
origin's bytes as a multiple of the model, and each host's GB/s. Targets are issue 26's (8
hosts within 1.5x one host's time; the origin sending at most 1.1x the model). Last, the
largest count's distribution again with a serving peer killed -9 mid-transfer
(:mod:`._fleetfault`): the others' warm time and the origin's bytes (at most 2x the model).
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tiering.serving.fleetjobs import FleetWorkerConfig

from ._datafiles import workdir
from ._fleetfault import ORIGIN_FAULT_TARGET, fault_run
from ._fleethosts import (
    Fleet,
    FleetBenchFailed,
    FleetBenchUnavailable,
    Host,
    catalog_database,
    forget_model,
    model_bytes_sent,
    started,
)
from ._measure import MiB, format_size
from ._netns import Net, network, why_no_netns
from ._origin import Origin, OriginUnavailable, open_origin
from ._postgres import NoScratchDatabase
from ._report import BenchRow, Report
from .fleet import MIN_SHARD, _by_hand, _check, _follow, _new_model, check_model

__all__ = ["parse_bits", "run"]

#: Issue 26's targets in the namespace bench.
TIME_TARGET, ORIGIN_TARGET, ORIGIN_TARGET_COMPRESSED = 1.5, 1.1, 0.75


def parse_bits(text: str) -> int:
    """``400Mbit``, ``2Gbit``, ``2.5G``, ``100000`` into bits per second (powers of 10)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:bit|bps|b)?(?:/s)?\s*", text.lower())
    if not m:
        raise ValueError(f"not a rate: {text!r} (use e.g. 400Mbit, 2Gbit)")
    bits = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    if bits < 1e5:
        raise ValueError(f"a link rate of {text!r} is too slow (at least 100kbit)")
    return int(bits)


def _warm(hosts: list[Host], model: str, nfiles: int) -> float:
    """Seconds from one ``POST /v1/fleet/prefetch`` naming ``hosts`` to its job done."""
    h = hosts[0]
    ids = [x.host_id for x in hosts]
    body = {"model": model, "hosts": ids, "target": "nvme"}
    t0 = time.monotonic()
    job = h.ok(h.http.post("/v1/fleet/prefetch", json=body), want=202)
    job = _follow(h, f"/v1/fleet/jobs/{job['id']}", job)
    elapsed = time.monotonic() - t0
    if job["state"] != "done" or job["files_done"] != nfiles * len(hosts):
        raise FleetBenchFailed(f"fleet job {job['id']} ended {job['state']}: {job}")
    return elapsed


def _checked(size: int, shards: int, counts: Sequence[int], runs: int, origin: str) -> list[int]:
    """The host counts, sorted, once each; ``ValueError``/``FleetBenchUnavailable`` for a run
    that cannot be measured."""
    ordered = sorted(set(counts))
    if not ordered or ordered[0] < 1 or runs < 1:
        raise ValueError("counts, runs and shards must be at least 1")
    check_model(size, shards)
    if origin not in ("open", "s3like"):
        raise FleetBenchUnavailable(
            f"--network measures the origin by nginx's access log: use --origin open or "
            f"s3like, not {origin!r}"
        )
    return ordered


def _why_loopback(netns: bool, say: Callable[[str], None]) -> str | None:
    """Why the run is on loopback (None: in network namespaces), said when asked for."""
    why = why_no_netns() if netns else "not asked for"
    if why is not None and netns:
        say(f"no network namespaces: {why}; running on loopback, links not shaped")
    return why


def _network_setup(
    net: Net | None, why: str | None, origin_bps: int, host_bps: int
) -> dict[str, Any]:
    return {
        "network": net.description if net else f"loopback, links not shaped ({why})",
        "netns": net is not None,
        "origin_bps": origin_bps if net else None,
        "host_bps": host_bps if net else None,
    }


@contextlib.contextmanager
def _started(
    why: str | None,
    hosts: int,
    origin: str,
    rate: int | None,
    poll: float,
    catalog_url: str | None,
    directory: Path | None,
    links: tuple[int, int],
    say: Callable[[str], None],
) -> Iterator[tuple[Net | None, str, Origin, Fleet]]:
    """The network (where ``why`` is None: namespaces, ``links`` = origin and host bits/s),
    the catalog, the origin and ``hosts`` servers, up for a run and taken down after it."""
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(workdir(directory))
        net: Net | None = None
        if why is None:
            net = stack.enter_context(network(hosts, *links, say))
        pg_url, server = stack.enter_context(
            catalog_database(catalog_url, say, socket=net is not None)
        )
        place = (net.origin.address, net.origin.wrap) if net else None
        org = stack.enter_context(
            open_origin(origin, rate=rate, parent=work, say=say, place=place, exact_log=True)
        )
        fleet = stack.enter_context(
            started(org, pg_url, work, hosts, poll, say, net.hosts if net else None)
        )
        yield net, server, org, fleet


def run(
    size: int = 128 * MiB,
    shards: int = 4,
    counts: Sequence[int] = (1, 4, 8),
    runs: int = 1,
    origin: str = "open",
    *,
    netns: bool = True,
    origin_bps: int = 400_000_000,
    host_bps: int = 2_000_000_000,
    rate: int | None = None,
    poll_interval: float | None = None,
    catalog_url: str | None = None,
    directory: Path | None = None,
    compressed: bool = False,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Warm times and origin bytes for each host count (see the module docstring).

    Parameters
    ----------
    counts
        Host counts measured; ``max(counts)`` hosts are started.
    origin, rate
        ``open`` (nginx, no cap of its own) or ``s3like`` (nginx, ``rate`` bytes/s per
        connection): the access log is the measure, so moto and URLs do not serve here.
    netns, origin_bps, host_bps
        Namespaces and ``tc`` links (needs root); the origin's egress cap and each host's link
        rate, bits/s. Without root the run is on loopback, unshaped, and says why.
    catalog_url
        As :func:`.fleet.run`; in namespaces the hosts must reach it (a Unix socket URL,
        ``postgresql+psycopg://user@/db?host=/socket/dir``, always does).

    Raises
    ------
    FleetBenchUnavailable, FleetBenchFailed
        As :func:`.fleet.run`.
    """
    counts = _checked(size, shards, counts, runs, origin)
    why = _why_loopback(netns, say)
    poll = poll_interval or FleetWorkerConfig().poll_interval_s
    seconds: dict[int, list[float]] = {n: [] for n in counts}
    sent: dict[int, list[int]] = {n: [] for n in counts}
    try:
        with _started(
            why, counts[-1], origin, rate, poll, catalog_url, directory, (origin_bps, host_bps), say
        ) as (net, server, org, fleet):
            fleet.compressed = compressed
            _measure(fleet, size, shards, counts, runs, seconds, sent, say)
            # Last: the killed host stays down.
            fault = fault_run(fleet, size, shards, counts[-1], say) if counts[-1] > 1 else None
    except (NoScratchDatabase, OriginUnavailable) as exc:
        raise FleetBenchUnavailable(str(exc)) from exc
    setup: dict[str, Any] = {
        **_network_setup(net, why, origin_bps, host_bps),
        "counts": counts,
        "shards": shards,
        "size_bytes": size,
        "runs": runs,
        "compressed": compressed,
        "origin": origin,
        "origin_description": org.description,
        "postgresql": server,
        "poll_interval_s": poll,
        "seconds": {str(n): v for n, v in seconds.items()},
        "origin_bytes": {str(n): v for n, v in sent.items()},
        "fault": fault,
        "checked": fleet.checked,
    }
    return _report(setup, seconds, sent)


def _measure(
    fleet: Fleet,
    size: int,
    shards: int,
    counts: list[int],
    runs: int,
    seconds: dict[int, list[float]],
    sent: dict[int, list[int]],
    say: Callable[[str], None],
) -> None:
    log = fleet.origin.access_log
    assert log is not None  # nginx: checked by run
    say("warm-up: a one-shard model by hand on every host (untimed)")
    warm = _new_model(fleet, "warm-up", MIN_SHARD, 1)
    _by_hand(fleet.hosts, [s.path for s in warm])
    _check(fleet, fleet.hosts, warm)
    forget_model(fleet, "warm-up")
    for r in range(runs):
        for n in counts:
            tag = f"r{r + 1}-n{n}"
            say(f"run {r + 1} of {runs}: {n} host(s), a new model of {format_size(size)}")
            model = _new_model(fleet, tag, size, shards)
            hosts = fleet.hosts[:n]
            seconds[n].append(_warm(hosts, tag, len(model)))
            # The log is unbuffered (exact_log): every request the job made is logged by now.
            sent[n].append(model_bytes_sent(fleet, tag))
            _check(fleet, hosts, model)
            forget_model(fleet, tag)
            say(
                f"  {seconds[n][-1]:.3f} s, the origin sent {sent[n][-1] / size:.2f}x the "
                f"model; the bytes checked on {n} host(s)"
            )


def _report(
    setup: dict[str, Any], seconds: dict[int, list[float]], sent: dict[int, list[int]]
) -> Report:
    size, counts = setup["size_bytes"], setup["counts"]
    report = Report(
        "fleet-network",
        f"tierd bench fleet-network (fleet --network): warm {format_size(size)} "
        f"({setup['shards']} shards) onto {', '.join(map(str, counts))} hosts; "
        f"{setup['network']}; medians of {setup['runs']}",
        setup,
    )
    ceiling = size * 8 / setup["origin_bps"] if setup["origin_bps"] else None
    if ceiling is not None:
        report.add(
            BenchRow(
                "ceiling_s",
                "origin-cap ceiling: the model once at the origin's egress rate",
                ceiling,
                "s",
            )
        )
    one = f"warm_{counts[0]}_s"
    # Compressed weights (issue 29): the origin sends their stored bytes, once.
    target = ORIGIN_TARGET_COMPRESSED if setup.get("compressed") else ORIGIN_TARGET
    for n in counts:
        t = statistics.median(seconds[n])
        key = f"warm_{n}_s"
        report.add(BenchRow(key, f"{n} host(s): one fleet prefetch, until done", t, "s"))
        if n != counts[0]:
            last = n == counts[-1] and counts[0] == 1
            report.compare(key, one, at_most=TIME_TARGET if last else None)
        if ceiling is not None:
            report.add(
                BenchRow(f"warm_{n}_ceiling_x", "  vs the origin-cap ceiling", t / ceiling, "x")
            )
        ratio = statistics.median(sent[n]) / size
        report.add(
            BenchRow(
                f"origin_{n}_x",
                "  origin bytes (its access log) / model bytes",
                ratio,
                "x",
                target=f"<= {target:g}x",
                met=ratio <= target,
            )
        )
        report.add(BenchRow(f"host_{n}_gbps", "  per host", size / t / 1e9, "GB/s"))
    fault = setup["fault"]
    if fault is not None:
        n = fault["hosts"]
        killed = f"{fault['killed']} killed -9" if fault["killed"] else "nobody killed"
        report.add(
            BenchRow(
                "fault_warm_s",
                f"{n} hosts, a serving peer killed mid-transfer ({killed}): the others, until done",
                fault["seconds"],
                "s",
                note=fault["why"],
            )
        )
        report.compare("fault_warm_s", f"warm_{n}_s")
        ratio = fault["origin_bytes"] / size
        report.add(
            BenchRow(
                "fault_origin_x",
                "  origin bytes (its access log) / model bytes",
                ratio,
                "x",
                target=f"<= {ORIGIN_FAULT_TARGET:g}x",
                met=ratio <= ORIGIN_FAULT_TARGET,
            )
        )
    return report
