"""Object-store tiers have no inotify: the watcher reconciles them on a period instead, paced
like its other full reconciles. A real S3 server (moto); another writer changes the bucket
behind tierd's back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.s3 import REGION
from tiering.catalog import FileState
from tiering.config import EngineConfig, TierConfig
from tiering.engine import Engine
from tiering.errors import FileNotFound


@pytest.fixture
def watched(
    tmp_path: Path, moto_server: str | None, moto_endpoint: str, s3_bucket: str, s3_env: Any
) -> Iterator[Engine]:
    cfg = EngineConfig(
        tiers=(
            TierConfig("nvme", tmp_path / "nvme"),
            TierConfig(
                "s3",
                kind="object",
                url=f"s3://{s3_bucket}/m",
                endpoint_url=moto_endpoint,
                region=REGION,
            ),
        ),
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}",
        watch=True,
        watch_backend="polling",
        remote_reconcile_s=0.2,
        access_flush_interval_s=0.05,
    )
    with Engine(cfg) as eng:
        yield eng


def _lookup(eng: Engine, relpath: str) -> Any:
    try:
        return eng.catalog.lookup(relpath)
    except FileNotFound:
        return None


def test_objects_added_changed_and_removed_behind_tierd_are_reconciled(
    watched: Engine, s3_client: Any, s3_bucket: str
) -> None:
    s3_client.put_object(Bucket=s3_bucket, Key="m/a/w.bin", Body=b"one")
    rec = wait_for(lambda: _lookup(watched, "a/w.bin"), what="the new object adopted")
    assert rec.tier == "s3" and rec.size == 3 and rec.etag
    s3_client.put_object(Bucket=s3_bucket, Key="m/a/w.bin", Body=b"three")
    wait_for(lambda: watched.catalog.lookup("a/w.bin").size == 5, what="the change seen")
    changed = watched.catalog.lookup("a/w.bin")
    assert changed.id == rec.id and changed.etag != rec.etag  # same file, new version
    s3_client.delete_object(Bucket=s3_bucket, Key="m/a/w.bin")
    wait_for(
        lambda: watched.catalog.lookup("a/w.bin").state == FileState.MISSING,
        what="the removal seen",
    )
    status = watched.watcher.status() if watched.watcher else None
    assert status is not None and status.last_full_reconcile_reason == (
        "periodic reconcile of the object-store tiers"
    )
