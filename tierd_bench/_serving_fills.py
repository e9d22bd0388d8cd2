"""The peer fills of ``tierd bench serving`` (:mod:`tierd_bench.serving`): while the clients'
small requests run, the measured server makes copies of a fleet's shared files from the pieces
a second tierd, its peer, holds.

With this phase the measured server is a host of a fleet of two: a PostgreSQL catalog (a
throwaway server, durable, or a scratch database on ``catalog_url``; see
:func:`._fleethosts.catalog_database`), a bucket (moto on loopback) as the shared tier
``bucket`` beside its directory tiers, and the fleet credential. The peer is a second tierd in
a process of its own, with its own host id and ``nvme``, started beside the measured server.
``fillers`` files of ``fill_size`` random bytes are put into the bucket, adopted by one scan,
and copied onto the peer's ``nvme`` (a prefetch, untimed): the peer holds every piece.

**The trigger** is the one a user meets: ``POST /v1/prefetch`` of a shared file to the measured
host, as an engine's start-up warming its model does (a fleet prefetch runs the same local
prefetch on each host, :mod:`tiering.serving.fleetjobs`). On a fleet it makes a copy on the
host's own tier from 8 MiB pieces, taken from the peers that hold them and checked against their
digests, the bucket only for what no live peer has (:mod:`tiering.copies.piecefill`). One filler
thread a file prefetches it back to back, its target alternating between ``nvme`` and
``page_cache`` (a copy on the nearest local tier faster than the bucket, ``hdd`` here): each
fill lands where the file's copy is not, so every fill takes the whole file from the peer again,
and the copy it replaces goes. The job is followed every 20 ms (as a client would); a fill's
time is the server's own account of it (the job's ``started_at`` to ``finished_at``), so the
polling's granularity is not in the figure.

**Checks**, each a failure of the bench: every job ends ``done`` with the file's bytes and no
error; after the fills with no client and after each window of fills, each file's copy on the
measured host's disk (exactly one, in a tier's ``.tierd-copies``) is hashed against the bytes
put into the bucket; over the run, the peer's ``tierd_peer_bytes_served`` grew by at least the
bytes filled and the measured host's ``tierd_origin_bytes_read`` of the bucket by none: the
peer, not the bucket, served every fill.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from tiering.checksum import hash_fd
from tiering.tiers.paths import RESERVED_DIR

from ._datafiles import write_random
from ._measure import format_size
from ._origin import REGION
from ._postgres import require_postgresql, why_no_postgresql
from .rest import follow_job, metric_total, server_process

__all__ = ["BUCKET_TIER", "FILL_TARGETS", "PeerFleet", "fill_once", "peer_fleet", "why_no_fills"]

#: The prefetch targets a file's fills take in turn (see the module docstring).
FILL_TARGETS = ("nvme", "page_cache")
#: The shared tier's name on both hosts, and the hosts' ids.
BUCKET_TIER = "bucket"
PEER, RECEIVER = "bench-peer", "bench-serving"
POLL_S = 0.02  # how often a filler asks whether its job is done
_JOB_TIMEOUT_S = 600.0


def why_no_fills(catalog_url: str | None) -> str | None:
    """Why the fills phase cannot run here, or None: it needs moto's server and PostgreSQL
    (Debian's, run by the bench, or a server ``catalog_url`` names)."""
    if catalog_url is not None:
        try:
            require_postgresql(catalog_url, ValueError)
        except ValueError as exc:
            return str(exc)
    try:
        import moto.server  # noqa: F401
    except ImportError as exc:
        return f"moto[server] is not installed ({exc})"
    reason = None if catalog_url is not None else why_no_postgresql()
    return None if reason is None else f"no PostgreSQL for a fleet's catalog: {reason}"


@dataclass
class FillFile:
    """One of the peer's files: where it is, its bytes' checksum, its id on the catalog, how
    many fills it had (the next one's target is ``FILL_TARGETS[turns % 2]``), copies checked."""

    relpath: str
    checksum: str
    size: int
    fid: int = 0
    turns: int = 0
    checked: int = 0


@dataclass
class PeerFleet:
    """The fleet of the fills phase once entered: the files, the peer (started in the
    background until :meth:`ready`), and the measured server's settings and data directory."""

    files: list[FillFile]
    data: Path  # the measured server's data directory (its tiers' copies are under it)
    env: dict[str, str]  # the measured server's settings, the fleet's included
    catalog: str  # what the catalog is, for the report
    put: Callable[[str, Path], None]  # puts a file into the bucket
    peer_started: Future[tuple[str, int]] | None = None
    peer_url: str = ""
    url: str = ""
    baseline: tuple[float, float] = (0.0, 0.0)  # the two counters before any fill
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ready(self, url: str, work: Path, say: Callable[[str], None]) -> None:
        """Once the measured server at ``url`` serves: the files into the bucket, adopted, and
        onto the peer's ``nvme``; their ids; the counters' baselines."""
        assert self.peer_started is not None
        self.peer_url, self.url = self.peer_started.result()[0], url
        size = format_size(self.files[0].size)
        say(f"{len(self.files)} files of {size} into the bucket, then onto {PEER}'s nvme")
        for f in self.files:
            src = work / "fill-source.bin"
            f.checksum = write_random(src, f.size)
            self.put(f.relpath, src)
            src.unlink()
        with httpx.Client(base_url=self.peer_url, timeout=600) as peer:
            _ok(peer.post("/v1/scan"), "the peer's scan")
            body = {"paths": [f.relpath for f in self.files], "target": "nvme"}
            job = _follow(peer, _ok(peer.post("/v1/prefetch", json=body), "the peer's prefetch"))
            if job["state"] != "done" or job["errors"]:
                raise RuntimeError(f"{PEER}: its prefetch ended {job['state']}: {job}")
        with httpx.Client(base_url=url, timeout=60) as http:
            for f in self.files:
                rec = _ok(http.get("/v1/files/lookup", params={"path": f.relpath}), f.relpath)
                if rec["tier"] != BUCKET_TIER or rec["size"] != f.size:
                    raise RuntimeError(f"{f.relpath} is {rec}, not on {BUCKET_TIER} at its size")
                f.fid = int(rec["id"])
        self.baseline = self._counters()

    def check_copy(self, http: httpx.Client, index: int) -> None:
        """The measured server's copy of file ``index`` on its disk: exactly one, of the
        file's current generation, with the bytes put into the bucket."""
        f = self.files[index]
        rec = _ok(http.get(f"/v1/files/{f.fid}"), f.relpath)
        name = f"{f.fid}.{rec['generation']}"
        found = sorted(p for p in self.data.glob(f"*/{RESERVED_DIR}/{name}") if p.is_file())
        if len(found) != 1:
            raise AssertionError(f"{f.relpath}: {len(found)} copies on the server's disk: {found}")
        with open(found[0], "rb") as fh:
            got = hash_fd(fh.fileno())
        if got != f.checksum:
            raise AssertionError(f"{f.relpath}: the copy at {found[0]} has other bytes")
        with self.lock:
            f.checked += 1

    def account(self, fills: int) -> dict[str, Any]:
        """What the counters say of the run's ``fills`` fills; AssertionError unless the peer
        served at least their bytes and the bucket sent the measured server none."""
        served0, origin0 = self.baseline
        served, origin = self._counters()
        size = self.files[0].size
        doc = {
            "fills": fills,
            "bytes_filled": fills * size,
            "peer_bytes_served": int(served - served0),
            "bucket_bytes_read": int(origin - origin0),
            "copies_checked": sum(f.checked for f in self.files),
        }
        if doc["bucket_bytes_read"] or doc["peer_bytes_served"] < doc["bytes_filled"]:
            raise AssertionError(f"the fills' bytes did not all come from the peer: {doc}")
        return doc

    def _counters(self) -> tuple[float, float]:
        """(bytes the peer served its fleet, bytes the measured server read from the bucket)."""
        served = _counter(self.peer_url, "tierd_peer_bytes_served_total")
        origin = _counter(self.url, "tierd_origin_bytes_read_total", f'tier="{BUCKET_TIER}"')
        return served, origin


def fill_once(http: httpx.Client, fleet: PeerFleet, index: int) -> tuple[float, float]:
    """One fill of file ``index`` on the measured server (a prefetch to its next target);
    returns its span: it ends when the bench saw the job done, and lasts the server's own
    account of the job."""
    f = fleet.files[index]
    target = FILL_TARGETS[f.turns % len(FILL_TARGETS)]
    f.turns += 1
    body = {"paths": [f.relpath], "target": target}
    job = _follow(http, _ok(http.post("/v1/prefetch", json=body), f"prefetch of {f.relpath}"))
    t1 = time.monotonic()
    if job["state"] != "done" or job["errors"] or job["bytes_done"] != f.size:
        raise RuntimeError(f"the fill of {f.relpath} ({target}) ended {job['state']}: {job}")
    started, finished = (datetime.fromisoformat(job[k]) for k in ("started_at", "finished_at"))
    return t1 - (finished - started).total_seconds(), t1


@contextlib.contextmanager
def peer_fleet(
    work: Path,
    env: dict[str, str],
    fillers: int,
    size: int,
    catalog_url: str | None,
    say: Callable[[str], None],
) -> Iterator[PeerFleet]:
    """The catalog, the bucket and the peer (starting in the background: :meth:`PeerFleet.ready`
    waits for it), all stopped after. ``env`` is the measured server's settings (its data
    directory is ``work / "data"``); the fleet's yields them with the fleet's added.

    Both hosts have the same tiers (the peer's directories its own), the shared one added: the
    policy is the catalog's, and a host refuses one that names a tier it does not have (it
    would keep its own, the scheduler on)."""
    from ._fleethosts import catalog_database
    from ._origin import open_origin

    with contextlib.ExitStack() as stack:
        pg_url, catalog = stack.enter_context(catalog_database(catalog_url, say))
        org = stack.enter_context(open_origin("moto", rate=None, parent=work, say=say))
        prefix = f"serving-fills-{secrets.token_hex(4)}"
        tier = {
            "name": BUCKET_TIER,
            "url": f"s3://{org.bucket}/{prefix}",
            "endpoint_url": org.endpoint,
            "region": REGION,
        }
        data = work / "data"
        tiers = json.loads(env.get("TIERD_TIERS", "null")) or [
            {"name": n, "path": str(data / n)} for n in ("nvme", "ssd", "hdd")
        ]
        peer_tiers = [
            t | {"path": str(work / "peer" / t["name"])} if "path" in t else t for t in tiers
        ]
        common = {"TIERD_CATALOG_URL": pg_url, "TIERD_FLEET_TOKEN": secrets.token_urlsafe(24)}
        peer_env = common | {
            "TIERD_HOST_ID": PEER,
            "TIERD_TIERS": json.dumps([*peer_tiers, tier]),
            "TIERD_LOG_LEVEL": "warning",
        }
        fleet = PeerFleet(
            [FillFile(f"fills/f{i}.bin", "", size) for i in range(fillers)],
            data,
            env | common | {"TIERD_HOST_ID": RECEIVER, "TIERD_TIERS": json.dumps([*tiers, tier])},
            catalog,
            lambda rel, path: org.put_file(f"{prefix}/{rel}", path),
        )
        # The peer starts while the caller starts the measured server (each start is seconds,
        # mostly waiting on imports and the catalog).
        peer = server_process(work / "peer", env=peer_env)
        pool = ThreadPoolExecutor(1, thread_name_prefix="tierd-bench-peer-start")
        fleet.peer_started = pool.submit(peer.__enter__)
        pool.shutdown(wait=False)
        stack.callback(_stop, peer, fleet.peer_started)
        yield fleet


def _stop(peer: contextlib.AbstractContextManager[Any], started: Future[Any]) -> None:
    """Stop the peer, once its start ended (a start that failed left nothing to stop)."""
    try:
        started.result()
    except BaseException:
        return
    peer.__exit__(None, None, None)


def _ok(r: httpx.Response, what: str) -> Any:
    if r.status_code not in (200, 202):
        raise RuntimeError(f"{what}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def _follow(http: httpx.Client, job: dict[str, Any]) -> dict[str, Any]:
    """``job`` once it has ended, asked every :data:`POLL_S`."""
    url, what = f"/v1/jobs/{job['id']}", f"job {job['id']}"
    return follow_job(
        job,
        lambda: _ok(http.get(url), what),
        poll_s=POLL_S,
        timeout_s=_JOB_TIMEOUT_S,
        late=lambda j: RuntimeError(f"{what} still {j['state']} after {_JOB_TIMEOUT_S:g} s"),
    )


def _counter(url: str, name: str, labels: str = "") -> float:
    """The sum of counter ``name``'s series at ``url``'s ``/metrics`` whose labels hold
    ``labels`` (0 where it has none yet)."""
    return metric_total(httpx.get(f"{url}/metrics", timeout=60).text, name, labels)
