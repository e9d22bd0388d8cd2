"""A compressing object tier (a real S3 server, moto, over HTTP): what tierd writes to a bucket
is stored as a container under ``.tierd-compressed/``, read back as the logical file by every
path (ranges, chunks, scan, stat), refused where its bytes are damaged, and one relpath stays
one object through overwrites that change its form."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_invariants, checksum, engine_settings, put
from tierd_bench.codec import synthetic_bf16
from tiering.codec import CHUNK, CODEC, MAGIC, CorruptContainer
from tiering.config import TierConfig
from tiering.engine import Engine
from tiering.errors import AlreadyExists, FileChanged
from tiering.sync.scan import scan
from tiering.tiers import Stat

MiB = 1 << 20
NAME = "m/model.safetensors"
Make = Callable[..., Any]


@pytest.fixture(scope="module")
def bf16() -> bytes:
    return synthetic_bf16(2 * CHUNK + 5 * MiB, tensors=5)


@pytest.fixture(scope="module")
def small() -> bytes:
    """One chunk's worth: a container too (over MIN_SIZE, and it pays), quick to move."""
    return synthetic_bf16(2 * MiB, tensors=2)


# Parts of 8 MiB (moto takes any size here): a few requests per object, not hundreds.
PARTS = {"part_size": 8 * MiB, "read_size": 8 * MiB}


def _write(tier: Any, relpath: str, data: bytes, **kw: Any) -> Any:
    with tier.writer(relpath, **kw) as w:
        for i in range(0, len(data), 3 * MiB):
            w.write(data[i : i + 3 * MiB])
        pub = w.publish()
    assert (pub.size, pub.stat.size, pub.checksum) == (len(data), len(data), checksum(data))
    return pub


def _keys(client: Any, bucket: str) -> dict[str, int]:
    listed = client.list_objects_v2(Bucket=bucket, Prefix="pre/").get("Contents", [])
    return {o["Key"]: o["Size"] for o in listed}


def test_stored_compressed_and_read_as_the_logical_file(
    make_object_tier: Make, s3_client: Any, s3_bucket: str, bf16: bytes
) -> None:
    tier = make_object_tier(compression="on", **PARTS)
    pub = _write(tier, NAME, bf16, checksum=checksum(bf16))
    keys = _keys(s3_client, s3_bucket)
    assert list(keys) == [f"pre/.tierd-compressed/{NAME}"]  # nothing at the plain key
    stored = keys[f"pre/.tierd-compressed/{NAME}"]
    assert stored <= 0.72 * len(bf16)
    assert (pub.stat.codec, pub.stat.stored_size) == (CODEC, stored)
    got = s3_client.get_object(Bucket=s3_bucket, Key=f"pre/.tierd-compressed/{NAME}")
    assert got["Body"].read(len(MAGIC)) == MAGIC
    assert got["Metadata"]["tierd-checksum"] == checksum(bf16)  # of the logical bytes

    st = tier.stat(NAME)
    assert (st.size, st.codec, st.stored_size, st.checksum) == (
        len(bf16),
        CODEC,
        stored,
        checksum(bf16),
    )
    with tier.open(NAME) as src:
        assert src.size == len(bf16) and src.local_file() is None
        assert src.ranges.encoded is src.container and src.ranges.source == "object_store"
        # Ranges inside chunks, across chunk edges, and the whole file.
        for off, n in [(0, 100), (CHUNK - 7, 19), (CHUNK + 12345, CHUNK), (len(bf16) - 3, 3)]:
            buf = bytearray(n)
            assert src.readinto(memoryview(buf), off) == n
            assert bytes(buf) == bf16[off : off + n]
        assert b"".join(bytes(c) for c in src.chunks(3 * MiB)) == bf16
        assert src.unchanged()
    # Opened from what the catalog records (no HEAD), as loads do.
    known = Stat(len(bf16), st.mtime_ns, st.version, codec=CODEC, stored_size=stored)
    with tier.open(NAME, etag=st.etag, known=known) as src:
        assert tier.read_bytes(NAME) == bf16
        buf = bytearray(len(bf16))
        src.readinto(memoryview(buf), 0)
        assert bytes(buf) == bf16
    (entry,) = list(tier.walk())
    assert (entry.relpath, entry.size, entry.codec) == (NAME, stored, CODEC)


def test_files_that_do_not_pay_stay_plain_and_both_forms_are_one_relpath(
    make_object_tier: Make, s3_client: Any, s3_bucket: str, small: bytes
) -> None:
    tier = make_object_tier(compression="on", **PARTS)
    noise = os.urandom(3 * MiB)
    _write(tier, "noise.bin", noise)
    assert list(_keys(s3_client, s3_bucket)) == ["pre/noise.bin"]
    assert tier.stat("noise.bin").codec is None
    # A relpath held in one form is taken in the other only with overwrite, which then
    # leaves one object: the new form.
    with pytest.raises(AlreadyExists):
        tier.writer("noise.bin")
    _write(tier, "noise.bin", small, overwrite=True)
    assert list(_keys(s3_client, s3_bucket)) == ["pre/.tierd-compressed/noise.bin"]
    assert tier.read_bytes("noise.bin") == small
    _write(tier, "noise.bin", noise, overwrite=True)
    assert list(_keys(s3_client, s3_bucket)) == ["pre/noise.bin"]
    # A tier that does not compress still sees (and refuses to clobber) a compressed object.
    _write(tier, "z.safetensors", small)
    plain = make_object_tier("plain", compression="off", **PARTS)
    with pytest.raises(AlreadyExists):
        plain.writer("z.safetensors")
    assert plain.read_bytes("z.safetensors") == small
    assert [e.relpath for e in plain.walk()] == ["noise.bin", "z.safetensors"]
    assert plain.remove("z.safetensors", version=plain.stat("z.safetensors").version)
    assert list(_keys(s3_client, s3_bucket)) == ["pre/noise.bin"]


def test_the_walk_merges_both_places_in_relpath_order(
    make_object_tier: Make, s3_client: Any, s3_bucket: str, bf16: bytes
) -> None:
    """Keys that sort between a relpath and its compressed key (``a.b`` sorts after ``a`` but
    ``.tierd-compressed/a`` before everything) still come in relpath order."""
    tier = make_object_tier(compression="on", **PARTS)
    small = b"x" * 1000
    for rel in ("a/1", "a.b", "b"):
        _write(tier, rel, small)
    for rel in ("a", "a/0", "c"):
        _write(tier, rel, bf16[: 2 * MiB])
    got = [(e.relpath, e.codec) for e in tier.walk()]
    assert got == [
        ("a", CODEC),
        ("a.b", None),
        ("a/0", CODEC),
        ("a/1", None),
        ("b", None),
        ("c", CODEC),
    ]
    # An interrupted overwrite leaves both forms: the walk yields the newer, once.
    s3_client.put_object(Bucket=s3_bucket, Key="pre/b", Body=small)  # older, plain
    s3_client.copy_object(
        Bucket=s3_bucket,
        Key="pre/.tierd-compressed/b",
        CopySource=f"{s3_bucket}/pre/.tierd-compressed/c",
    )
    assert [(e.relpath, e.codec) for e in tier.walk() if e.relpath == "b"] == [("b", CODEC)]


def test_a_damaged_object_is_an_error_naming_it_never_bytes(
    make_object_tier: Make, s3_client: Any, s3_bucket: str, small: bytes
) -> None:
    tier = make_object_tier(compression="on", **PARTS)
    _write(tier, NAME, small)
    key = f"pre/.tierd-compressed/{NAME}"
    body = bytearray(s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[len(body) // 3] ^= 0x40  # inside chunk 0's stored bytes (the only chunk)
    s3_client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    with (
        tier.open(NAME) as src,
        pytest.raises(CorruptContainer, match=r"model.safetensors.*chunk 0"),
    ):
        src.readinto(memoryview(bytearray(100)), 0)
    # A replaced object read at the ETag that was opened is a change, not its new bytes.
    st = tier.stat(NAME)
    with tier.open(NAME) as src:
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body[:-1]))
        with pytest.raises(FileChanged):
            src.readinto(memoryview(bytearray(100)), MiB)
    assert st.codec == CODEC


def test_moves_compress_into_the_bucket_and_scan_adopts_them_back(
    tmp_path: Path,
    moto_endpoint: str,
    s3_bucket: str,
    s3_env: Any,
    s3_client: Any,
    small: bytes,
) -> None:
    """The default (``auto``) object tier: a demotion stores the container, the catalog keeps
    the logical size and checksum with the codec and stored size, promotion decodes, and a
    catalog rebuilt from the bucket adopts the object with its logical size."""
    s3 = TierConfig(
        "s3", kind="object", url=f"s3://{s3_bucket}/pre", endpoint_url=moto_endpoint,
        region="us-east-1", part_size=5 * MiB,
    )  # fmt: skip
    settings = engine_settings(tmp_path / "data")
    config = settings.engine_config()
    config = dataclasses.replace(config, tiers=(*config.tiers, s3))
    with Engine(config) as eng:
        fid = put(eng, NAME, small).id
        eng.migrate(fid, "s3")
        rec = eng.get(fid)
        stored = _keys(s3_client, s3_bucket)[f"pre/.tierd-compressed/{NAME}"]
        assert (rec.tier, rec.size, rec.codec, rec.stored_size) == ("s3", len(small), CODEC, stored)
        assert rec.checksum == checksum(small)
        assert_invariants(eng, {NAME: small})
        assert not scan(eng.catalog, eng.tiers).changed  # the listing's stored size matches
        eng.migrate(fid, "nvme")
        assert (settings.data_dir / "nvme" / NAME).read_bytes() == small
        assert _keys(s3_client, s3_bucket) == {}
        eng.migrate(fid, "s3")
    fresh = tmp_path / "fresh.db"
    with Engine(dataclasses.replace(config, catalog_url=f"sqlite:///{fresh}")) as eng:
        scan(eng.catalog, eng.tiers)
        rec = eng.catalog.lookup(NAME)
        assert (rec.tier, rec.size, rec.codec, rec.checksum) == (
            "s3",
            len(small),
            CODEC,
            checksum(small),
        )
        assert_invariants(eng, {NAME: small})
