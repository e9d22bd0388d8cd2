"""The fleet that ``tierd bench fleet`` measures: a PostgreSQL catalog, and tierd servers in
processes of their own, each a host with its own id and data directory (a directory tier
``nvme`` of its own above the shared bucket tier ``s3``), started side by side and stopped at
the end whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tiering.catalog import upgrade
from tiering.catalog.backends import redact
from tiering.tiers.paths import COMPRESSED_DIR

from ._netns import Place
from ._origin import REGION, Origin
from ._postgres import PgServer, scratch_database, why_no_postgresql
from .rest import server_process

__all__ = [
    "Fleet",
    "FleetBenchFailed",
    "FleetBenchUnavailable",
    "Host",
    "catalog_database",
    "forget",
    "started",
]


class FleetBenchUnavailable(Exception):
    """The bench cannot run here as asked: no PostgreSQL, a bad ``--catalog-url``, no origin."""


class FleetBenchFailed(RuntimeError):
    """A measure went wrong: a job failed, or a host's copy is missing or has wrong bytes."""


@dataclass
class Host:
    """One started tierd: its host id, data directory, URL, a client of its API, and its
    process id (for the fault run's kill)."""

    host_id: str
    root: Path
    url: str
    http: httpx.Client
    pid: int = 0

    def ok(self, r: httpx.Response, *, want: int = 200) -> Any:
        """``r``'s JSON body, or :class:`FleetBenchFailed` naming the host if not ``want``."""
        if r.status_code != want:
            raise FleetBenchFailed(
                f"host {self.host_id}: {r.request.method} {r.request.url.path} answered "
                f"{r.status_code}: {r.text[:500]}"
            )
        return r.json()


@dataclass
class Fleet:
    """The started hosts, the origin and the s3 tier's prefix; what the bytes checks saw."""

    hosts: list[Host]
    origin: Origin
    prefix: str  # the s3 tier's prefix in the bucket
    work: Path
    #: The models are bf16 weights stored as tierd stores them in a bucket: compressed.
    compressed: bool = False
    checked: dict[str, int] = field(
        default_factory=lambda: {"measures": 0, "copies": 0, "bytes_compared": 0}
    )


@contextlib.contextmanager
def catalog_database(
    url: str | None, say: Callable[[str], None], *, socket: bool = False
) -> Iterator[tuple[str, str]]:
    """(a migrated, empty catalog database, and what it is). ``socket``: the throwaway
    server's URL names its Unix socket, which hosts in other network namespaces reach too."""
    if url is not None:
        with scratch_database(url) as scratch:
            upgrade(scratch)
            yield scratch, f"{redact(url)} (a scratch database, dropped afterwards)"
        return
    reason = why_no_postgresql()
    if reason is not None:
        raise FleetBenchUnavailable(f"no PostgreSQL to run here ({reason}); pass --catalog-url")
    say("starting a throwaway PostgreSQL (durable: fsync and synchronous commit on)")
    with PgServer(durable=True) as server:
        db = server.create_database()
        if socket:
            yield server.socket_url(db), "throwaway server, durable, on its Unix socket"
        else:
            yield server.url(db), "throwaway server, durable, on loopback"


def _host_env(
    org: Origin,
    prefix: str,
    root: Path,
    host_id: str,
    url: str,
    poll: float,
    tokens: tuple[str, str],
) -> dict[str, str]:
    s3: dict[str, Any] = {
        "name": "s3",
        "url": f"s3://{org.bucket}/{prefix}",
        "endpoint_url": org.endpoint,
    }
    if org.kind != "url":  # a URL's region comes from the AWS chain
        s3["region"] = REGION
    return {
        "TIERD_CATALOG_URL": url,
        "TIERD_HOST_ID": host_id,
        "TIERD_TIERS": json.dumps([{"name": "nvme", "path": str(root / "nvme")}, s3]),
        "TIERD_FLEET_POLL_INTERVAL_S": repr(poll),
        "TIERD_LOG_LEVEL": "warning",
        # A host off loopback starts only with a token; on loopback it costs nothing. The
        # fleet credential lets the hosts read from each other (GET /v1/peer/content).
        "TIERD_ADMIN_TOKEN": tokens[0],
        "TIERD_FLEET_TOKEN": tokens[1],
    }


@contextlib.contextmanager
def started(
    org: Origin,
    url: str,
    work: Path,
    n: int,
    poll: float,
    say: Callable[[str], None],
    places: Sequence[Place] | None = None,
) -> Iterator[Fleet]:
    """``n`` tierd servers, on loopback or each at its ``places[i]`` (a network namespace)."""
    prefix = f"tfb-{secrets.token_hex(4)}"
    token, fleet_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    at = list(places) if places is not None else [Place((), "127.0.0.1")] * n
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: forget(org, prefix))
        ids = [f"bench-host-{i}" for i in range(n)]
        say(f"starting {n} tierd servers: {', '.join(ids)}")
        servers = [
            server_process(
                work / h,
                env=_host_env(org, prefix, work / h, h, url, poll, (token, fleet_token)),
                host=p.address,
                wrap=p.wrap,
            )
            for h, p in zip(ids, at, strict=True)
        ]
        # Side by side: each start (imports, catalog, scan) takes seconds, mostly waiting.
        with ThreadPoolExecutor(n, thread_name_prefix="tierd-bench-start") as pool:
            started = [pool.submit(cm.__enter__) for cm in servers]
        failed: BaseException | None = None
        hosts = []
        for h, cm, fut in zip(ids, servers, started, strict=True):
            try:
                base, pid = fut.result()
            except BaseException as exc:  # the others were started: they are stopped below
                failed = failed or exc
                continue
            stack.push(cm)
            auth = {"Authorization": f"Bearer {token}"}
            http = stack.enter_context(httpx.Client(base_url=base, timeout=600, headers=auth))
            hosts.append(Host(h, work / h, base, http, pid))
        if failed is not None:
            raise failed
        first = hosts[0]
        # No move by heat while measuring: the policy is the catalog's, so one PUT covers all.
        policy = first.ok(first.http.get("/v1/policy"))["policy"]
        first.ok(first.http.put("/v1/policy", json=policy | {"enabled": False}))
        _wait_all_up(first, [h.host_id for h in hosts])
        yield Fleet(hosts, org, prefix, work)


def forget(org: Origin, prefix: str) -> None:
    with contextlib.suppress(Exception):
        org.delete_prefix(prefix)


def model_prefixes(fleet: Fleet, tag: str) -> list[str]:
    """Where model ``tag``'s objects are in the bucket: its plain keys and its compressed ones
    (an object tier keeps those under its prefix's ``.tierd-compressed/``)."""
    return [f"{fleet.prefix}/{tag}", f"{fleet.prefix}/{COMPRESSED_DIR}/{tag}"]


def forget_model(fleet: Fleet, tag: str) -> None:
    for prefix in model_prefixes(fleet, tag):
        forget(fleet.origin, prefix)


def model_bytes_sent(fleet: Fleet, tag: str) -> int:
    """Bytes the origin's access log says it sent for model ``tag`` (both places)."""
    from ._nginx import bytes_sent

    log = fleet.origin.access_log
    assert log is not None  # nginx: checked by the callers
    return sum(bytes_sent(log, fleet.origin.bucket, p) for p in model_prefixes(fleet, tag))


def _wait_all_up(h: Host, ids: list[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        items = h.ok(h.http.get("/v1/fleet/hosts"))["items"]
        up = {x["host_id"] for x in items if x["state"] == "up"}
        if set(ids) <= up:
            return
        if time.monotonic() > deadline:
            raise FleetBenchFailed(f"hosts up after {timeout:g} s: {sorted(up)}, not all of {ids}")
        time.sleep(0.1)
