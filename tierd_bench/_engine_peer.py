"""The peer row of ``tierd bench engine``: an engine on a host that holds none of the files,
served from a second host of its fleet.

Two tierd hosts on loopback (:func:`._fleethosts.started`: one PostgreSQL catalog, a bucket
tier on an S3 origin (moto) above each host's own ``nvme``, the fleet credential set). The
model is put into the bucket and adopted by one scan; host 0 prefetches it onto its ``nvme``
(the page cache holds it too); each measured process asks host 1, which holds no copy, so its
loads read host 0's copy (``source`` ``peer``). Without PostgreSQL or the origin the row is
skipped, saying why.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ._engine_rows import Engine, Measured, repeat
from ._fleethosts import FleetBenchFailed, Host
from .rest import follow_job

__all__ = ["peer_row"]

_JOB_TIMEOUT_S = 1800.0


def peer_row(
    engine: Engine,
    tmp: Path,
    name: str,
    repeats: int,
    say: Callable[[str], None],
    catalog_url: str | None = None,
) -> Measured:
    """Row ``peer``: ``repeats`` fresh processes loading ``name`` from host 1 of two."""
    from tiering.serving.fleetjobs import FleetWorkerConfig

    from ._fleethosts import FleetBenchUnavailable, catalog_database, started
    from ._origin import OriginUnavailable, open_origin
    from ._postgres import NoScratchDatabase

    m = Measured("peer", "tierd REST load_state_dict on a host holding nothing, from a peer")
    try:
        with ExitStack() as stack:
            pg_url, _ = stack.enter_context(catalog_database(catalog_url, say))
            org = stack.enter_context(open_origin("moto", rate=None, parent=tmp, say=say))
            poll = FleetWorkerConfig().poll_interval_s
            fleet = stack.enter_context(started(org, pg_url, tmp / "fleet", 2, poll, say))
            holder, asked = fleet.hosts
            say(f"peer: the model into the bucket, then onto {holder.host_id}'s nvme")
            for f in sorted(engine.files[0].parent.iterdir()):
                org.put_file(f"{fleet.prefix}/{name}/{f.name}", f)
            holder.ok(holder.http.post("/v1/scan"))
            shards = [f"{name}/{f.name}" for f in engine.files]
            job = holder.ok(
                holder.http.post("/v1/prefetch", json={"paths": shards, "target": "nvme"}),
                want=202,
            )
            _wait(holder, job)
            token = str(asked.http.headers["Authorization"]).removeprefix("Bearer ")
            m.note = f"asked {asked.host_id}; {holder.host_id} holds the model on its nvme"
            args = engine.args("tierd", url=asked.url, name=name, shared=False, token=token)
            return repeat(engine, m, lambda: [args], repeats, say, url=asked.url, token=token)
    except (FleetBenchUnavailable, NoScratchDatabase, OriginUnavailable) as exc:
        m.note = f"not measured: {exc}"
        return m


def _wait(host: Host, job: dict[str, Any]) -> None:
    """Until ``host``'s prefetch ``job`` is done (:class:`FleetBenchFailed` if it fails)."""
    url = f"/v1/jobs/{job['id']}"
    job = follow_job(
        job,
        lambda: host.ok(host.http.get(url)),
        poll_s=0.05,
        timeout_s=_JOB_TIMEOUT_S,
        late=lambda j: FleetBenchFailed(f"host {host.host_id}: the prefetch still {j['state']}"),
    )
    if job["state"] != "done" or job.get("errors"):
        raise FleetBenchFailed(f"host {host.host_id}: the prefetch ended {job}")
