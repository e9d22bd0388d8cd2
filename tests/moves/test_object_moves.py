"""Moves between a directory tier and an object-store tier (a real S3 server, moto, over HTTP):
demotion by multipart upload, promotion by parallel ranged GETs, the same journal and
recovery as local moves, and kill -9 at every step in both directions, with the bytes and the
bucket checked after each (one verified copy, no unfinished multipart upload)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_invariants, checksum, payload, put, tier_files
from tests.s3 import REGION, raw_client
from tierd_bench.codec import synthetic_bf16
from tiering.catalog import FileState, MigrationPhase
from tiering.codec import CODEC
from tiering.config import EngineConfig, TierConfig
from tiering.engine import Engine
from tiering.errors import IntegrityError
from tiering.moves import STEPS

PART = 64 << 10  # moto is told to accept parts this small (tests.s3)
SIZE = 5 * PART + 123  # several parts, so "copying" is in the middle of a multipart upload
_BF16 = synthetic_bf16(3 << 20, tensors=2)  # stored compressed: a container of many parts


@pytest.fixture
def s3_config(
    tmp_path: Path, moto_server: str | None, moto_endpoint: str, s3_bucket: str, s3_env: Any
) -> EngineConfig:
    """Two tiers, a directory above a bucket prefix, and a catalog built by Alembic."""
    tiers = (
        TierConfig("nvme", tmp_path / "nvme"),
        TierConfig(
            "s3",
            kind="object",
            url=f"s3://{s3_bucket}/models",
            endpoint_url=moto_endpoint,
            region=REGION,
            part_size=PART,
            connections=4,
        ),
    )
    return EngineConfig(
        tiers=tiers,
        catalog_url=f"sqlite:///{tmp_path / 'catalog.db'}",
        watch=False,
        access_flush_interval_s=0.05,
    )


@pytest.fixture
def s3eng(s3_config: EngineConfig) -> Iterator[Engine]:
    with Engine(s3_config) as e:
        e.mover.chunk_size = PART
        yield e


def _uploads(client: Any, bucket: str) -> list[str]:
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def test_demote_and_promote_check_the_bytes_at_every_step(
    s3eng: Engine, s3_client: Any, s3_bucket: str
) -> None:
    data = payload(SIZE)
    rec = put(s3eng, "llama/model.safetensors", data)
    down = s3eng.migrate(rec.id, "s3")
    assert down.record.phase == MigrationPhase.DONE
    # In the bucket: the bytes, tierd's checksum in the metadata, and no local copy left.
    got = s3_client.get_object(Bucket=s3_bucket, Key="models/llama/model.safetensors")
    assert got["Body"].read() == data
    assert got["Metadata"]["tierd-checksum"] == checksum(data)
    on_s3 = s3eng.catalog.lookup("llama/model.safetensors")
    assert on_s3.tier == "s3" and on_s3.etag == got["ETag"].strip('"')
    assert on_s3.checksum == checksum(data)
    assert tier_files(s3eng) == {"llama/model.safetensors": ["s3"]}
    assert _uploads(s3_client, s3_bucket) == []
    # Reads are served from the bucket, unchanged.
    content = s3eng.open_content(rec.id)
    assert b"".join(content.iter_range(0, SIZE)) == data
    up = s3eng.migrate(rec.id, "nvme")
    assert up.record.phase == MigrationPhase.DONE
    back = s3eng.catalog.lookup("llama/model.safetensors")
    assert back.tier == "nvme" and back.etag is None and back.generation == rec.generation + 2
    assert_invariants(s3eng, {"llama/model.safetensors": data})
    assert "Contents" not in s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="models/")


def test_an_object_changed_behind_tierd_is_not_moved(
    s3eng: Engine, s3_client: Any, s3_bucket: str
) -> None:
    data = payload(SIZE)
    rec = put(s3eng, "m/w.bin", data)
    s3eng.migrate(rec.id, "s3")
    s3_client.put_object(Bucket=s3_bucket, Key="models/m/w.bin", Body=b"x" * SIZE)
    with pytest.raises(IntegrityError, match="changed since it was cataloged"):
        s3eng.migrate(rec.id, "nvme")
    after = s3eng.catalog.get(rec.id)
    assert after.state == FileState.QUARANTINED and after.tier == "s3"
    # Nothing was written locally, and the bucket holds what the other writer put there.
    assert tier_files(s3eng) == {"m/w.bin": ["s3"]}
    body = s3_client.get_object(Bucket=s3_bucket, Key="models/m/w.bin")["Body"].read()
    assert body == b"x" * SIZE


def test_an_adopted_object_gets_its_checksum_from_its_first_move(
    s3eng: Engine, s3_client: Any, s3_bucket: str
) -> None:
    data = payload(SIZE)
    s3_client.put_object(Bucket=s3_bucket, Key="models/hf/config.json", Body=b"{}")
    s3_client.put_object(Bucket=s3_bucket, Key="models/hf/model.safetensors", Body=data)
    report = s3eng.scan()
    assert sorted(report.adopted) == ["hf/config.json", "hf/model.safetensors"]
    rec = s3eng.catalog.lookup("hf/model.safetensors")
    assert rec.tier == "s3" and rec.checksum is None and rec.etag
    assert not s3eng.scan().drift  # adopted objects are unchanged on the next pass
    s3eng.migrate(rec.id, "nvme")
    assert s3eng.catalog.get(rec.id).checksum == checksum(data)
    s3eng.migrate(rec.id, "s3")
    assert_invariants(s3eng, {"hf/model.safetensors": data})


# -- kill -9 at every step, both directions ---------------------------------------------------
def _child(config: EngineConfig, file_id: int, dst: str, step: str) -> None:
    # A forked process: open the engine (its own S3 client), move, SIGKILL ourselves at step.
    try:
        eng = Engine(config).open()
        eng.mover.chunk_size = PART

        def hook(s: str) -> None:
            if s == step:
                os.kill(os.getpid(), signal.SIGKILL)

        eng.mover.hook = hook
        eng.migrate(file_id, dst)
    finally:
        os._exit(3)  # reached only if the step never came


def _crash_move(config: EngineConfig, file_id: int, dst: str, step: str) -> None:
    p = multiprocessing.get_context("fork").Process(
        target=_child, args=(config, file_id, dst, step)
    )
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL, f"child exit code {p.exitcode} at step {step}"


# The steps a CI run crashes at; --runslow crashes at every one. A compressed object (the
# tier's default for files that pay) in CI: mid-upload of the container, and published.
QUICK = {"plain": ("copying", "published", "source_unlinked"), "bf16": ("copying", "published")}


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("direction", ["demote", "promote"])
@pytest.mark.parametrize("form", ["plain", "bf16"])
def test_kill_9_at_every_step(
    s3_config: EngineConfig,
    s3_client: Any,
    s3_bucket: str,
    step: str,
    direction: str,
    form: str,
    request: pytest.FixtureRequest,
) -> None:
    if step not in QUICK[form] and not request.config.getoption("--runslow"):
        pytest.skip("slow: pass --runslow for every step")
    data = payload(SIZE) if form == "plain" else _BF16
    src, dst = ("nvme", "s3") if direction == "demote" else ("s3", "nvme")
    with Engine(s3_config) as eng:
        rec = put(eng, "d/f0.bin", data, tier=src)
    _crash_move(s3_config, rec.id, dst, step)
    committed = STEPS.index(step) >= STEPS.index("switched")
    with Engine(s3_config) as eng:  # recovery runs at start
        assert_invariants(eng, {"d/f0.bin": data})
        now = eng.catalog.get(rec.id)
        assert now.tier == (dst if committed else src)
        if form == "bf16" and now.tier == "s3":
            assert now.codec == CODEC and s3_client.head_object(
                Bucket=s3_bucket, Key="models/.tierd-compressed/d/f0.bin"
            )
        assert _uploads(s3_client, s3_bucket) == []  # no orphaned multipart upload
        before = tier_files(eng)
        second = eng.mover.recover()
        assert not second.changed  # recovery run twice changes nothing the second time
        assert tier_files(eng) == before
        # The file moves again normally after recovery, both ways.
        here = eng.catalog.get(rec.id).tier
        eng.migrate(rec.id, "nvme" if here == "s3" else "s3")
        eng.migrate(rec.id, here)
        assert_invariants(eng, {"d/f0.bin": data})
    with Engine(dataclasses.replace(s3_config)) as eng:  # and a restart changes nothing
        assert eng.last_recovery is not None and not eng.last_recovery.changed
        assert_invariants(eng, {"d/f0.bin": data})


def test_an_upload_into_the_bucket_that_crashed_leaves_no_multipart_upload(
    s3_config: EngineConfig, moto_endpoint: str, s3_bucket: str
) -> None:
    # A crash in the middle of an upload (PUT /v1/files/content onto the object tier): the
    # unfinished multipart upload is aborted at the next start. (The tier stores files as they
    # are here: a compressing one starts its upload at the encoder's decision, after 32 MiB.)
    nvme, s3 = s3_config.tiers
    s3_config = dataclasses.replace(
        s3_config, tiers=(nvme, dataclasses.replace(s3, compression="off"))
    )
    ctx = multiprocessing.get_context("fork")

    def child() -> None:
        try:
            eng = Engine(s3_config).open()
            up = eng.begin_upload("new/w.bin", tier="s3")
            up.write(payload(3 * PART))
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(3)

    p = ctx.Process(target=child)
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    client = raw_client(moto_endpoint)
    try:
        assert _uploads(client, s3_bucket) == ["models/new/w.bin"]
        with Engine(s3_config) as eng:
            assert _uploads(client, s3_bucket) == []
            assert tier_files(eng) == {}
            with pytest.raises(Exception, match="no file"):
                eng.lookup("new/w.bin")
    finally:
        client.close()
