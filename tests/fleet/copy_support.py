"""Helpers of the fleet's copy and memory-tier tests: engines of two hosts on one PostgreSQL
catalog sharing one moto bucket (in-process, each with its own data directory), objects put
in the bucket, a policy document, heat driven through an engine's own access tracker, and
what a host holds on disk and in the catalog."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.conftest import make_settings
from tests.s3 import REGION
from tiering.catalog import Copies
from tiering.config import EngineConfig
from tiering.copies.hostcopies import HostCopies
from tiering.engine import Engine

KiB = 1 << 10
HL = 1000.0  # the policies' half-life: a test's few seconds decay heat by well under 1 %
PREFIX = "m"


def put_objects(s3_client: Any, bucket: str, n: int = 5) -> dict[str, bytes]:
    """``n`` objects ``f<i>.bin`` of 64 KiB + i bytes (each size its own) under ``PREFIX``."""
    data = {f"f{i}.bin": os.urandom(64 * KiB + i) for i in range(n)}
    for rel, body in data.items():
        s3_client.put_object(Bucket=bucket, Key=f"{PREFIX}/{rel}", Body=body)
    return data


def fleet_config(
    root: Path,
    host: str,
    catalog_url: str,
    endpoint: str,
    bucket: str,
    *,
    dirs: tuple[str, ...] = ("nvme", "ssd"),
    memory_quota: int | None = None,
    **overrides: Any,
) -> EngineConfig:
    """Host ``host``'s engine: an optional memory tier ``ram``, directory tiers ``dirs`` under
    ``root``, then the shared bucket tier ``s3``."""
    tiers: list[dict[str, Any]] = []
    if memory_quota is not None:
        tiers.append({"name": "ram", "kind": "memory", "quota_bytes": memory_quota})
        overrides.setdefault("memory_floor_bytes", 0)  # the CI host's free memory is no subject
    tiers += [{"name": d, "path": root / d} for d in dirs]
    tiers.append(
        {
            "name": "s3",
            "url": f"s3://{bucket}/{PREFIX}",
            "endpoint_url": endpoint,
            "region": REGION,
            "connections": 2,
        }
    )
    return make_settings(
        root, host_id=host, catalog_url=catalog_url, watch=False, tiers=tiers, **overrides
    ).engine_config()


@contextlib.contextmanager
def started(config: EngineConfig) -> Iterator[Engine]:
    """A started engine whose passes the test runs (no scheduler)."""
    e = Engine(config).start(scheduler=False)
    try:
        yield e
    finally:
        e.stop()


def policy_doc(
    promotion_heat: str = "local", *, memory: bool = False, **rules: dict[str, Any]
) -> dict[str, Any]:
    """A policy: ``ram`` 1000 (with ``memory``), nvme 100, ssd 10, s3 0 by default, ±20 %
    hysteresis, half-life :data:`HL`; ``rules`` replace a tier's (``nvme={...}``)."""
    tiers: dict[str, dict[str, Any]] = {"nvme": {"min_heat": 100}, "ssd": {"min_heat": 10}}
    if memory:
        tiers = {"ram": {"min_heat": 1000}, "nvme": {"min_heat": 100}}
    tiers = {**tiers, **rules, "s3": {"min_heat": 0}}
    return {
        "tiers": tiers,
        "half_life_s": HL,
        "hysteresis": 0.2,
        "min_age_s": 0,
        "promotion_heat": promotion_heat,
    }


def set_policy(doc: dict[str, Any], *engines: Engine) -> None:
    """Store ``doc`` through the first engine; the others pick it up from the shared catalog."""
    first, *rest = engines
    first.set_policy(doc)
    for e in rest:
        assert e.reload_policy().version == first.policy_info().version


def heat(engine: Engine, counts: dict[int, int]) -> float:
    """Count accesses on ``engine``'s host through its tracker, flush them; returns the time
    after the flush (heats are as counted, give or take the decay of a few ms)."""
    assert engine.access is not None
    for fid, n in counts.items():
        engine.access.record(fid, n)
    engine.access.flush()
    return time.time()


def hc(engine: Engine) -> HostCopies:
    assert engine.host_copies is not None
    return engine.host_copies


def held(engine: Engine) -> dict[int, str]:
    """file id -> tier of this host's copies, checked three ways: the copy files on disk (each
    byte-equal to the object), the catalog's rows, and the cache's index all agree."""
    host = engine.config.host_id
    disk: dict[int, str] = {}
    for tier in hc(engine).holders:
        d = tier.local_root / ".tierd-copies"
        for p in d.iterdir() if d.is_dir() else ():
            fid, _, gen = p.name.partition(".")
            rec = engine.get(int(fid))
            assert int(gen) == rec.generation, p
            assert int(fid) not in disk, f"two copies of file {fid}"
            disk[int(fid)] = tier.name
    assert engine.db is not None
    rows = {r.file_id: r.location for r in Copies(engine.db).list(host=host)}
    rows = {fid: loc for fid, loc in rows.items() if loc != "ram"}
    index = {e.file_id: e.tier for e in hc(engine).entries()}
    assert disk == rows == index, (disk, rows, index)
    return disk


def copy_bytes(engine: Engine, file_id: int) -> bytes:
    rec = engine.get(file_id)
    src = hc(engine).open(rec)
    assert src is not None, f"no current copy of {file_id}"
    with src:
        local = src.local_file()
        assert local is not None  # a copy is a local file
        return local.path.read_bytes()
