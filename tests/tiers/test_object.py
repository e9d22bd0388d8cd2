"""What only an object-store tier has: its URL, the start-up check and its four failure
reasons, ETags, multipart uploads with tierd's checksum in the metadata, and retries of
transient failures (injected request by request by a proxy in front of the S3 server)."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.s3 import ACCESS_KEY, SECRET_KEY, MotoIam, raw_client
from tests.s3_faults import FaultProxy
from tiering.checksum import Hasher
from tiering.errors import FileChanged, IntegrityError, TierUnavailable
from tiering.tiers import UNBOUNDED

KiB = 1 << 10
PART = 64 * KiB
Make = Callable[..., Any]


def checksum(data: bytes) -> str:
    h = Hasher()
    h.update(data)
    return h.value()


def put(tier: Any, relpath: str, data: bytes, **kwargs: Any) -> Any:
    with tier.writer(relpath, **kwargs) as w:
        for i in range(0, len(data), 10_000):
            w.write(data[i : i + 10_000])
        return w.publish()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- configuration ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    [
        "http://bucket/prefix",
        "s3://",
        "s3://b/prefix",
        "s3://user:secret@bucket/prefix",
        "s3://bucket/a/../b",
        "s3://bucket/p?x=1",
        "s3://bad_/p",
    ],
)
def test_bad_urls_are_refused_at_construction(make_object_tier: Make, url: str) -> None:
    with pytest.raises(ValueError, match="tier 's3'"):
        make_object_tier(url=url)


def test_endpoint_with_a_password_is_refused(make_object_tier: Make) -> None:
    with pytest.raises(ValueError, match="must not carry a user or password") as info:
        make_object_tier(endpoint_url="http://key:hunter2@127.0.0.1:9000")
    assert "hunter2" not in str(info.value)


def test_location_space_and_prefixless_tier(make_object_tier: Make, s3_bucket: str) -> None:
    tier = make_object_tier()
    assert tier.location.startswith(f"s3://{s3_bucket}/pre at http://127.0.0.1:")
    assert tier.space().free == UNBOUNDED and tier.space().total is None
    root = make_object_tier("root", url=f"s3://{s3_bucket}")
    root.check()
    put(root, "top.bin", b"top")
    assert [e.relpath for e in root.walk()] == ["top.bin"]
    assert tier.stat("top.bin") is None  # another prefix


# -- check(): the four reasons a store is unusable -----------------------------------------
def test_check_missing_bucket(make_object_tier: Make) -> None:
    tier = make_object_tier(url="s3://tierd-no-such-bucket-here/pre")
    with pytest.raises(TierUnavailable) as info:
        tier.check()
    assert "tierd-no-such-bucket-here" in str(info.value) and "no such bucket" in str(info.value)
    assert info.value.details["reason"] == "no_such_bucket"


def test_check_unreachable_endpoint_fails_fast(make_object_tier: Make) -> None:
    tier = make_object_tier(endpoint_url=f"http://127.0.0.1:{closed_port()}")
    t0 = time.monotonic()
    with pytest.raises(TierUnavailable, match="endpoint unreachable") as info:
        tier.check()
    assert info.value.details["reason"] == "unreachable"
    assert not tier.reachable()
    assert time.monotonic() - t0 < 10


def test_check_without_credentials(make_object_tier: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    tier = make_object_tier()
    with pytest.raises(TierUnavailable, match="no credentials found") as info:
        tier.check()
    assert info.value.details["reason"] == "no_credentials"


@pytest.mark.parametrize("which", ["unknown key", "wrong secret"])
def test_check_bad_credentials(
    make_object_tier: Make, moto_iam: MotoIam, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    key, _secret = moto_iam.user("s3:*")
    if which == "unknown key":
        key = "AKIATIERDUNKNOWNKEY0"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    moto_iam.enforce()
    tier = make_object_tier()
    with pytest.raises(TierUnavailable, match="bad credentials") as info:
        tier.check()
    assert info.value.details["reason"] == "bad_credentials"
    assert key not in str(info.value) and SECRET_KEY not in str(info.value)


def test_check_access_denied(
    make_object_tier: Make, moto_iam: MotoIam, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, secret = moto_iam.user("s3:ListBucket", "s3:GetObject")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    moto_iam.enforce()
    tier = make_object_tier()
    with pytest.raises(TierUnavailable, match="access denied") as info:
        tier.check()
    assert info.value.details["reason"] == "access_denied"
    assert tier.reachable()  # reading is allowed


def test_signed_requests_work_when_the_server_checks_them(
    make_object_tier: Make, moto_iam: MotoIam, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, secret = moto_iam.user("s3:*")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    moto_iam.enforce()
    tier = make_object_tier()
    tier.check()
    data = os.urandom(3 * PART + 5)
    put(tier, "signed.bin", data)
    assert tier.read_bytes("signed.bin") == data


def test_credentials_never_shown(
    make_object_tier: Make,
    moto_iam: MotoIam,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    key, _ = moto_iam.user("s3:*")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)  # the wrong secret
    moto_iam.enforce()
    tier = make_object_tier()
    shown = [repr(tier), tier.location, str(tier.config)]
    with pytest.raises(TierUnavailable) as info:
        tier.check()
    shown += [str(info.value), repr(info.value.details)]
    assert not tier.reachable()
    with pytest.raises(TierUnavailable) as info2:
        tier.stat("x")
    shown.append(str(info2.value))
    for text in shown:
        assert key not in text and SECRET_KEY not in text, text
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("tiering")]
    assert ours, "the unreachable tier is logged"
    assert not any(key in m or SECRET_KEY in m for m in ours)
    # Not even botocore's debug output carries the secret (it signs with it, never sends it).
    assert not any(SECRET_KEY in r.getMessage() for r in caplog.records)


# -- ETags -------------------------------------------------------------------------------------
def test_open_with_the_catalogs_etag(object_tier: Any) -> None:
    pub = put(object_tier, "e.bin", b"etag me")
    assert pub.etag == pub.stat.version == object_tier.stat("e.bin").etag
    for etag in (pub.etag, f'"{pub.etag}"'):
        with object_tier.open("e.bin", etag=etag) as src:
            assert src.stat.version == pub.etag
    with pytest.raises(FileChanged, match="changed behind tierd's back"):
        object_tier.open("e.bin", etag="0123456789abcdef")


def test_reads_after_a_replace_behind_tierds_back_are_refused(
    object_tier: Any, s3_client: Any, s3_bucket: str
) -> None:
    data = os.urandom(5 * PART)
    put(object_tier, "w.bin", data)
    with object_tier.open("w.bin") as src:
        buf = bytearray(PART)
        assert src.readinto(memoryview(buf), 0) == PART
        s3_client.put_object(Bucket=s3_bucket, Key="pre/w.bin", Body=os.urandom(5 * PART))
        with pytest.raises(FileChanged):
            src.readinto(memoryview(buf), PART)
        with pytest.raises(FileChanged):
            src.readinto(memoryview(bytearray(len(data))), 0)  # the parallel path
        with pytest.raises(FileChanged):
            b"".join(src.chunks(PART))
        assert not src.unchanged()
    with object_tier.open("w.bin") as src:
        s3_client.delete_object(Bucket=s3_bucket, Key="pre/w.bin")
        with pytest.raises(FileChanged):
            src.readinto(memoryview(buf), 0)


def test_conditional_delete_spares_a_newer_version(
    object_tier: Any, s3_client: Any, s3_bucket: str
) -> None:
    old = put(object_tier, "d.bin", b"old")
    s3_client.put_object(Bucket=s3_bucket, Key="pre/d.bin", Body=b"newer")
    assert not object_tier.store.delete_exact("pre/d.bin", old.etag)
    assert not object_tier.remove("d.bin", version=old.etag)
    assert object_tier.read_bytes("d.bin") == b"newer"


# -- multipart uploads -------------------------------------------------------------------------
def test_multipart_upload_of_several_parts(
    make_object_tier: Make, s3_client: Any, s3_bucket: str
) -> None:
    tier = make_object_tier(parts_in_flight=2)  # write() waits for parts: memory is bounded
    data = os.urandom(5 * PART + 123)
    pub = put(tier, "big/model.safetensors", data, checksum=checksum(data))
    assert pub.etag.endswith("-6")  # five full parts and the rest
    assert tier.read_bytes("big/model.safetensors") == data
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_checksum_is_stored_in_the_metadata(
    object_tier: Any, s3_client: Any, s3_bucket: str
) -> None:
    data = os.urandom(2 * PART + 1)
    pub = put(object_tier, "c.bin", data, checksum=checksum(data))
    head = s3_client.head_object(Bucket=s3_bucket, Key="pre/c.bin")
    assert head["Metadata"]["tierd-checksum"] == checksum(data)
    assert pub.stat.checksum == object_tier.stat("c.bin").checksum == checksum(data)
    # Without an expected checksum nothing is claimed.
    assert put(object_tier, "n.bin", b"n").stat.checksum is None


def test_bytes_that_do_not_match_the_expected_checksum_are_never_published(
    object_tier: Any, s3_client: Any, s3_bucket: str
) -> None:
    with pytest.raises(IntegrityError, match="nothing was published"):
        put(object_tier, "bad.bin", b"some bytes", checksum=checksum(b"other bytes"))
    assert object_tier.stat("bad.bin") is None
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_an_open_writer_is_an_unfinished_upload(
    object_tier: Any, s3_client: Any, s3_bucket: str
) -> None:
    with object_tier.writer("u.bin", temp_stem="f9.i9") as w:
        w.write(b"u" * 100)
        listed = s3_client.list_multipart_uploads(Bucket=s3_bucket)["Uploads"]
        assert [(u["Key"], u["UploadId"]) for u in listed] == [("pre/u.bin", w.upload_id)]
        assert w.sync().version == f"upload:{w.upload_id}"
        assert object_tier.stat("u.bin") is None
        assert list(object_tier.temps()) == [("u.bin", "")]
    assert list(object_tier.temps()) == []


def test_walk_skips_markers_temps_and_invalid_keys(
    object_tier: Any, s3_client: Any, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    for key in [
        "pre/ok/a.bin",
        "pre/dir/",
        "pre/a//b",
        "pre/./x",
        "pre/.tierd-probe-1.tierd-tmp",
        "pre/sub/.f1.i1.tierd-tmp",
        "prefix2/outside.bin",
        "outside.bin",
    ]:
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=b"k")
    s3_client.create_multipart_upload(Bucket=s3_bucket, Key="other/upload.bin")
    with caplog.at_level(logging.WARNING, logger="tiering"):
        assert [e.relpath for e in object_tier.walk()] == ["ok/a.bin"]
    assert any("a//b" in r.getMessage() for r in caplog.records)
    assert list(object_tier.temps()) == []  # uploads outside the prefix are not tierd's


def test_check_sweeps_probes_left_by_a_crashed_check(
    object_tier: Any, s3_client: Any, s3_bucket: str
) -> None:
    s3_client.put_object(Bucket=s3_bucket, Key="pre/.tierd-probe-dead.tierd-tmp", Body=b"p")
    object_tier.check()
    left = s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="pre/").get("Contents", [])
    assert left == []
    object_tier.close()
    object_tier.close()  # idempotent


# -- transient failures are retried; permanent ones fail clearly --------------------------------
def via_proxy(make_object_tier: Make, proxy: FaultProxy, **kwargs: Any) -> Any:
    return make_object_tier("s3", endpoint_url=proxy.url, **kwargs)


def test_upload_survives_503_slowdown_and_resets(
    make_object_tier: Make, fault_proxy: FaultProxy
) -> None:
    rules = [
        fault_proxy.fail("503", method="POST", query="uploads"),
        fault_proxy.fail("slowdown", method="PUT", query="partNumber=", nth=1),
        fault_proxy.fail("reset", method="PUT", query="partNumber=", nth=3),
        fault_proxy.fail("500", method="PUT", query="partNumber=", nth=5),
        fault_proxy.fail("reset", method="HEAD", nth=2),
    ]
    tier = via_proxy(make_object_tier, fault_proxy)
    data = os.urandom(4 * PART + 99)
    pub = put(tier, "retry/up.bin", data, checksum=checksum(data))
    assert all(r.fired == 1 for r in rules), [(r.action, r.fired) for r in rules]
    direct = make_object_tier("direct")
    assert direct.read_bytes("retry/up.bin") == data
    assert direct.stat("retry/up.bin").version == pub.etag


def test_reads_survive_503_resets_and_broken_bodies(
    make_object_tier: Make, fault_proxy: FaultProxy
) -> None:
    data = os.urandom(6 * PART + 1)
    put(make_object_tier("direct"), "retry/down.bin", data)
    rules = [
        fault_proxy.fail("503", method="HEAD", nth=1),
        fault_proxy.fail("truncate", method="GET", header="Range", nth=2),
        fault_proxy.fail("reset", method="GET", header="Range", nth=4),
        fault_proxy.fail("slowdown", method="GET", header="Range", nth=6),
        fault_proxy.fail("truncate", method="GET", header="Range", nth=9),
    ]
    tier = via_proxy(make_object_tier, fault_proxy, read_engine="boto3")
    with tier.open("retry/down.bin") as src:
        buf = bytearray(len(data))
        assert src.readinto(memoryview(buf), 0) == len(data)
        assert bytes(buf) == data
        assert b"".join(bytes(c) for c in src.chunks(PART // 2)) == data
    assert all(r.fired == 1 for r in rules), [(r.action, r.fired) for r in rules]


def test_a_completion_whose_answer_was_lost_is_recognised(
    make_object_tier: Make, fault_proxy: FaultProxy
) -> None:
    """The store completed the upload but the answer never came; the retried completion is
    refused (412, the key exists now). The writer's own token in the metadata shows the object
    is its own, so the publish succeeds instead of reporting a clash."""
    lost = fault_proxy.fail("drop_response", method="POST", query="uploadId=", nth=1)
    clash = fault_proxy.fail("412", method="POST", query="uploadId=", nth=2)
    tier = via_proxy(make_object_tier, fault_proxy)
    data = os.urandom(2 * PART)
    pub = put(tier, "lost.bin", data, checksum=checksum(data))
    assert (lost.fired, clash.fired) == (1, 1)
    assert pub.size == len(data) and tier.read_bytes("lost.bin") == data


def test_a_publish_the_head_cannot_verify_is_taken_back(
    make_object_tier: Make, fault_proxy: FaultProxy
) -> None:
    """A store that loses the metadata (here: a HEAD answer without it) fails verification:
    the writer removes the object it just published and raises."""

    def drop_checksum(status: int, headers: list[Any], body: bytes) -> tuple[int, Any, bytes]:
        return status, [h for h in headers if h[0].lower() != "x-amz-meta-tierd-checksum"], body

    # HEADs 1 and 2 are the writer's "does the name exist" checks (the plain key and the
    # compressed one), HEAD 3 its verification.
    fault_proxy.fail("edit", method="HEAD", nth=3, edit=drop_checksum)
    tier = via_proxy(make_object_tier, fault_proxy)
    data = os.urandom(PART + 1)
    with pytest.raises(IntegrityError, match="failed verification.*it was removed"):
        put(tier, "unverified.bin", data, checksum=checksum(data))
    assert tier.stat("unverified.bin") is None


def test_permanent_errors_fail_clearly_and_leave_nothing(
    make_object_tier: Make, fault_proxy: FaultProxy, s3_client: Any, s3_bucket: str
) -> None:
    fault_proxy.fail("403", method="PUT", query="partNumber=", times=1000)
    tier = via_proxy(make_object_tier, fault_proxy)
    with pytest.raises(TierUnavailable, match="access denied"):
        put(tier, "denied.bin", os.urandom(3 * PART))
    assert tier.stat("denied.bin") is None
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_reads_give_up_after_max_attempts(make_object_tier: Make, fault_proxy: FaultProxy) -> None:
    put(make_object_tier("direct"), "gone.bin", os.urandom(PART))
    rule = fault_proxy.fail("truncate", method="GET", header="Range", times=1000)
    tier = via_proxy(make_object_tier, fault_proxy, max_attempts=3)
    with tier.open("gone.bin") as src, pytest.raises(TierUnavailable, match="failed 3 times"):
        src.readinto(memoryview(bytearray(PART)), 0)
    assert rule.fired == 3


def test_the_check_client_does_not_retry_for_long(
    make_object_tier: Make, fault_proxy: FaultProxy
) -> None:
    rule = fault_proxy.fail("500", times=1000)
    tier = via_proxy(make_object_tier, fault_proxy)
    with pytest.raises(TierUnavailable, match="keeps failing"):
        tier.check()
    assert rule.fired == 2, fault_proxy.log


def test_raw_client_helper_is_closed(moto_endpoint: str) -> None:
    client = raw_client(moto_endpoint, key=ACCESS_KEY)
    client.close()


# -- the promotion's reader: KvikIO's RemoteFile where installed --------------------------------
def test_read_engine_is_validated(make_object_tier: Make) -> None:
    with pytest.raises(ValueError, match="read_engine"):
        make_object_tier(read_engine="curl")
    try:
        import kvikio.remote_file as rf

        usable = rf.is_remote_file_available()
    except ImportError:
        usable = False
    if not usable:  # asked for by name where it cannot run: refused when the tier is made
        with pytest.raises(ValueError, match="kvikio"):
            make_object_tier(read_engine="kvikio")


def kvikio_tier(make_object_tier: Make, **kwargs: Any) -> Any:
    rf = pytest.importorskip("kvikio.remote_file", reason="needs KvikIO (the GPU machine)")
    if not rf.is_remote_file_available():
        pytest.skip("this KvikIO has no remote I/O")
    return make_object_tier(read_engine="kvikio", **kwargs)


def test_chunks_through_kvikio(make_object_tier: Make, s3_client: Any, s3_bucket: str) -> None:
    tier = kvikio_tier(make_object_tier)
    data = os.urandom(7 * PART + 5)
    put(tier, "k.bin", data)
    with tier.open("k.bin") as src:
        assert b"".join(bytes(c) for c in src.chunks(PART // 2)) == data
        assert src.unchanged()
        s3_client.put_object(Bucket=s3_bucket, Key="pre/k.bin", Body=os.urandom(len(data)))
        with pytest.raises(FileChanged):  # the URL is presigned only for the version opened
            b"".join(src.chunks(PART))
        assert not src.unchanged()


def test_kvikio_blocks_that_fail_are_read_again_by_botocore(
    make_object_tier: Make, fault_proxy: FaultProxy
) -> None:
    data = os.urandom(6 * PART + 1)
    put(make_object_tier("direct"), "retry/kv.bin", data)
    rules = [
        fault_proxy.fail("truncate", method="GET", header="Range", nth=2),
        fault_proxy.fail("reset", method="GET", header="Range", nth=4),
        fault_proxy.fail("500", method="GET", header="Range", nth=5),
    ]
    tier = kvikio_tier(make_object_tier, endpoint_url=fault_proxy.url)
    with tier.open("retry/kv.bin") as src:
        assert b"".join(bytes(c) for c in src.chunks(PART)) == data
    assert all(r.fired == 1 for r in rules), [(r.action, r.fired) for r in rules]


# -- obstore's GETs, and fork() ------------------------------------------------------------------
def test_gets_go_through_obstore_where_installed(make_object_tier: Make) -> None:
    pytest.importorskip("obstore")
    tier = make_object_tier()
    data = os.urandom(3 * PART + 17)
    put(tier, "o.bin", data)
    assert tier.store.get_engine == "obstore"
    buf = bytearray(len(data) - 5)
    with tier.open("o.bin") as src:
        assert src.readinto(memoryview(buf), 5) == len(buf)
    assert bytes(buf) == data[5:]
    assert make_object_tier(read_engine="boto3").store.get_engine == "botocore"


def _read_in_child(config: Any, size: int, out: Any) -> None:
    from tiering.tiers._object import ObjectTier

    tier = ObjectTier(config, 0)  # the child's own tier: a parent's threads do not fork
    buf = bytearray(size)
    with tier.open("f.bin") as src:
        src.readinto(memoryview(buf), 0)
    out.put((tier.store.get_engine, checksum(bytes(buf))))


def test_a_child_forked_after_obstore_started_reads_with_botocore(make_object_tier: Make) -> None:
    """obstore's runtime does not survive fork(): the child must not wait on it forever."""
    import multiprocessing

    pytest.importorskip("obstore")
    tier = make_object_tier()
    data = os.urandom(2 * PART)
    put(tier, "f.bin", data)
    with tier.open("f.bin") as src:  # the parent's runtime starts here
        src.readinto(memoryview(bytearray(PART)), 0)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(tier.config, len(data), out))
    child.start()
    try:
        assert out.get(timeout=60) == ("botocore", checksum(data))
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
