"""The object store unreachable (every request to the bucket's endpoint reset, through a
fault-injecting proxy in front of a real S3 server): loads of files on the directory tiers go
on; a move to or from the bucket fails cleanly (the source authoritative and intact, no temp,
the file stable, the migration aborted with the reason) and the scheduler tries it again, less
and less often, until the store is back; ``/readyz`` says ``degraded`` and why."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.api.health import readyz
from tests.conftest import wait_for
from tests.helpers import put, tier_files
from tests.s3 import REGION
from tests.s3_faults import FaultProxy, Rule
from tiering.config import EngineConfig, TierConfig
from tiering.engine import Engine
from tiering.errors import TierdError

LOCAL = bytes(range(256)) * 300  # on the directory tier
REMOTE = b"r" * 5000  # in the bucket


def _config(tmp: Path, bucket: str, endpoint: str) -> EngineConfig:
    return EngineConfig(
        tiers=(
            TierConfig("nvme", tmp / "nvme"),
            TierConfig(
                "s3",
                kind="object",
                url=f"s3://{bucket}/models",
                endpoint_url=endpoint,
                region=REGION,
                part_size=64 << 10,
                connections=2,
            ),
        ),
        catalog_url=f"sqlite:///{tmp / 'catalog.db'}",
        watch=False,
        access_flush_interval_s=0.05,
    )


@pytest.fixture
def eng(tmp_path: Path, fault_proxy: FaultProxy, s3_bucket: str, s3_env: Any) -> Iterator[Engine]:
    with Engine(_config(tmp_path, s3_bucket, fault_proxy.url)) as e:
        yield e


def _down(proxy: FaultProxy) -> Rule:
    """Every request to the store from now on is reset, as by a dead endpoint."""
    return proxy.fail("reset", times=1 << 30)


def _up(proxy: FaultProxy, rule: Rule) -> None:
    with proxy.state.lock:
        proxy.state.rules.remove(rule)


def _read(eng: Engine, file_id: int) -> bytes:
    content = eng.open_content(file_id)
    return b"".join(content.iter_range(0, content.size))


def test_moves_fail_cleanly_and_local_loads_go_on(eng: Engine, fault_proxy: FaultProxy) -> None:
    local = put(eng, "m/local.bin", LOCAL, tier="nvme")
    remote = put(eng, "m/remote.bin", REMOTE, tier="s3")
    before = tier_files(eng)
    assert before == {"m/local.bin": ["nvme"], "m/remote.bin": ["s3"]}
    rule = _down(fault_proxy)

    assert _read(eng, local.id) == LOCAL  # a load from the directory tier goes on
    for rec, dst in ((local, "s3"), (remote, "nvme")):
        with pytest.raises(TierdError) as err:
            eng.migrate(rec.id, dst)
        assert err.value.code in ("tier_unavailable", "storage_error"), err.value
        now = eng.catalog.get(rec.id)
        assert now.state == "stable" and now.tier == rec.tier
        [row] = eng.migrations(file_id=rec.id)
        assert row.record.phase == "aborted" and row.record.error
    assert not any(p.is_file() for p in (eng.tiers.get("nvme").local_root or Path()).rglob(".*"))
    assert (eng.tiers.get("nvme").local_root / "m/local.bin").read_bytes() == LOCAL  # type: ignore[operator]

    r = readyz(eng)
    body = json.loads(bytes(r.body))
    assert r.status_code == 200 and body["status"] == "degraded"
    [why] = body["degraded"]
    assert why["component"] == "tier:s3" and "does not answer" in why["reason"]

    _up(fault_proxy, rule)
    assert tier_files(eng) == before  # nothing was left in the bucket either
    assert _read(eng, remote.id) == REMOTE
    assert json.loads(bytes(readyz(eng).body))["status"] == "ready"


def test_the_scheduler_retries_with_backoff_until_the_store_is_back(
    eng: Engine, fault_proxy: FaultProxy
) -> None:
    local = put(eng, "m/local.bin", LOCAL, tier="nvme")
    policy = eng.policy_info().policy.model_dump(mode="json")
    eng.set_policy(policy | {"interval_s": 0.1})
    rule = _down(fault_proxy)
    eng.pin(local.id, "s3")  # the next passes bring it to its pin, and fail

    def failed() -> list[Any]:
        return [m for m in eng.migrations(file_id=local.id) if m.record.phase == "aborted"]

    wait_for(lambda: len(failed()) >= 2, timeout=30, what="two failed attempts")
    assert eng.catalog.get(local.id).tier == "nvme"
    assert _read(eng, local.id) == LOCAL

    # Backing off: a pass now skips it, saying why, instead of trying every 0.1 s.
    def backing_off() -> bool:
        report = eng.scheduler.last_pass
        return report is not None and any("failed attempt" in why for _, why in report.skipped)

    wait_for(backing_off, what="a pass that skips the file while it backs off")
    _up(fault_proxy, rule)
    wait_for(lambda: eng.catalog.get(local.id).tier == "s3", timeout=60, what="the retried move")
    assert tier_files(eng) == {"m/local.bin": ["s3"]}
    assert _read(eng, local.id) == LOCAL
    phases = [m.record.phase for m in eng.migrations(file_id=local.id)]
    assert phases[0] == "done" and set(phases[1:]) == {"aborted"}
