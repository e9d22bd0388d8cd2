"""``tierd bench tracker``'s rows for one fleet (see :mod:`tierd_bench.tracker`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._report import BenchRow, Report

__all__ = ["Fleet", "fleet_rows"]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _latencies(
    report: Report, k: str, polls: list[float], steady: list[float], late: list[float]
) -> None:
    """The p50/p99 rows of the polls (all, and those after the fleet's first second) and of
    the clients' lag."""
    for key, label, xs, target in (
        ("read", "poll", polls, 0.05),
        ("steady", "poll after the fleet's first second", steady, None),
        ("late", "poll started late (the clients' lag)", late, None),
    ):
        p50, p99 = _pct(xs, 0.5), _pct(xs, 0.99)
        report.add(
            BenchRow(f"{k}_{key}_p50", f"  {label} p50", None if p50 is None else p50 * 1e3, "ms")
        )
        report.add(
            BenchRow(
                f"{k}_{key}_p99",
                f"  {label} p99",
                None if p99 is None else p99 * 1e3,
                "ms",
                target=None if target is None else f"< {target * 1e3:g}",
                met=None if p99 is None or target is None else p99 < target,
            )
        )


@dataclass(frozen=True)
class Fleet:
    """One fleet's shape: ``n`` hosts, a model of ``count`` pieces, ``pps`` landings a second a
    host, the fleet's polls held to ``budget`` a second."""

    n: int
    count: int
    pps: float
    budget: float


def fleet_rows(
    report: Report,
    fleet: Fleet,
    results: list[dict[str, Any]],
    wall: float,
    cpu: float,
    wal: int,
) -> None:
    """One fleet's rows, from its client processes' results."""
    from tiering.fleet.peerwindow import POLL_S

    sims = [h for r in results for h in r["hosts"]]
    polls = [x for h in sims for x in h["polls"]]
    # The fleet's start (every host reads the map and every holding, and claims) is a burst;
    # the polls after its first second show the tracker as a rollout goes on.
    steady = [x for h in sims for x, b in zip(h["polls"], h["began"], strict=True) if b >= 1.0]
    late = [x for r in results for x in r["late"]]
    elapsed = sum(h["elapsed"] for h in sims)
    # Pieces the hosts landed (told the catalog) over the time they ran: a fill's loop starts
    # no fetch while it waits on the tracker, so the share of its time spent waiting is the
    # share of its link the tracker takes.
    took = sum(h["told"] / h["elapsed"] for h in sims if h["elapsed"] > 0)
    blocked = sum(h["blocked"] for h in sims) / elapsed if elapsed else 1.0
    n, pps, budget = fleet.n, fleet.pps, fleet.budget
    asked = n * pps
    k = f"n{n}"
    note = f"asked {asked:,.0f}/s ({took / asked:.0%})"
    report.add(BenchRow(f"{k}_events", f"{n} hosts: piece events/s taken", took, "/s", note=note))
    # Each host polls every PeerWindow.interval, which grows with the hosts it has seen filling
    # (the fleet's polls held to the budget): asked, the polls a second at the intervals the
    # hosts ended with.
    asked_polls = sum(1 / h["interval"] for h in sims)
    interval = _pct([h["interval"] for h in sims], 0.5) or POLL_S
    polled = len(polls) / (elapsed / n) if elapsed else 0.0
    note = f"asked {asked_polls:,.0f}/s ({polled / asked_polls:.0%})"
    report.add(BenchRow(f"{k}_polls", "  polls/s (one transaction each)", polled, "/s", note=note))
    report.add(
        BenchRow(
            f"{k}_interval",
            "  a host's poll interval (median)",
            interval * 1e3,
            "ms",
            note=f"{POLL_S * 1e3:g} ms up to {budget * POLL_S:,.0f} hosts filling, then "
            f"hosts / {budget:,.0f} a second",
        )
    )
    _latencies(report, k, polls, steady, late)
    # A server given by URL is not this machine's to measure.
    pg = cpu / wall if cpu else None
    report.add(BenchRow(f"{k}_pg_cpu", "  PostgreSQL CPU", pg, "cores"))
    # What sizes a fleet's PostgreSQL: its CPU a poll (the fleet's start, a few calls a host,
    # counted in), and so the hosts one core of it serves at a poll every POLL_S.
    per = cpu / len(polls) if cpu and polls else None
    report.add(
        BenchRow(
            f"{k}_pg_per_poll",
            "  PostgreSQL CPU a poll",
            None if per is None else per * 1e3,
            "ms",
            note=""
            if per is None
            else f"{POLL_S / per:,.0f} hosts a core at a poll every {POLL_S:g} s",
        )
    )
    clients = sum(r["cpu"] for r in results) / wall
    report.add(BenchRow(f"{k}_client_cpu", "  the simulated hosts' CPU", clients, "cores"))
    report.add(BenchRow(f"{k}_wal", "  WAL written", wal / wall / 1e6, "MB/s"))
    report.add(BenchRow(f"{k}_blocked", "  fills' time waiting on the tracker", blocked, "x"))
    _rollout(report, fleet, took, interval, polled < 0.9 * asked_polls, polled / asked_polls)


def _rollout(
    report: Report, fleet: Fleet, took: float, interval: float, lagged: bool, share: float
) -> None:
    """The rollout time the tracker allows, against the link's time for the model."""
    k, n, count, pps = f"n{fleet.n}", fleet.n, fleet.count, fleet.pps
    ideal = count / pps
    # The fills' time stretched by their waits on the tracker, plus a poll interval: peers
    # learn of a host's last pieces up to a poll after they landed.
    tracker = n * count / took + interval if took else float("inf")
    report.add(
        BenchRow(
            f"{k}_rollout",
            "  rollout the tracker allows, x the link's time",
            tracker / ideal,
            "x",
            target="<= 1.1",
            # Clients that could not poll as often as asked put less load on the tracker
            # than a fleet would: then the figure is not the tracker's (met: None).
            met=None if lagged else tracker <= 1.1 * ideal,
            note=f"{tracker:.1f} s against {ideal:.1f} s"
            + (f"; clients polled {share:.0%} of asked: not measured" if lagged else ""),
        )
    )
