"""One suite, every backend: what the :class:`~tiering.tiers.Tier` interface promises holds for a
local directory and for an S3-protocol bucket alike (the ``tier`` fixture runs each test on
both, the way fsspec's ``tests/abstract`` runs on every filesystem)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tiering.checksum import Hasher
from tiering.errors import (
    AlreadyExists,
    FileNotFound,
    InsufficientSpace,
    IntegrityError,
    InvalidPath,
    TierdError,
)

KiB = 1 << 10


def checksum(data: bytes) -> str:
    h = Hasher()
    h.update(data)
    return h.value()


def put(tier: Any, relpath: str, data: bytes, **kwargs: Any) -> Any:
    with tier.writer(relpath, **kwargs) as w:
        # Uneven writes, so part and chunk boundaries fall mid-write.
        for i in range(0, len(data), 50_000):
            w.write(data[i : i + 50_000])
        return w.publish()


def test_publish_then_read_back(tier: Any) -> None:
    data = os.urandom(200 * KiB + 7)
    pub = put(tier, "models/a/weights.bin", data)
    assert (pub.relpath, pub.size, pub.checksum) == (
        "models/a/weights.bin",
        len(data),
        checksum(data),
    )
    st = tier.stat("models/a/weights.bin")
    assert st is not None and st.size == len(data)
    assert st.version == pub.stat.version and st.mtime_ns == pub.stat.mtime_ns > 0
    assert tier.read_bytes("models/a/weights.bin") == data
    assert tier.name in repr(tier)


def test_readinto_ranges_and_eof(tier: Any) -> None:
    data = os.urandom(300 * KiB + 11)
    put(tier, "r.bin", data)
    with tier.open("r.bin") as src:
        assert src.size == len(data)
        for offset, length in [(0, 10), (64 * KiB - 5, 20), (100, 250 * KiB), (0, len(data))]:
            buf = bytearray(length)
            assert src.readinto(memoryview(buf), offset) == length
            assert bytes(buf) == data[offset : offset + length]
        buf = bytearray(100)
        assert src.readinto(memoryview(buf), len(data) - 5) == 5
        assert bytes(buf[:5]) == data[-5:]
        assert src.readinto(memoryview(buf), len(data)) == 0
        assert src.readinto(memoryview(buf), len(data) + 10) == 0
        # A buffer longer than the rest of the file, read in parallel parts.
        big = bytearray(len(data) + 1000)
        assert src.readinto(memoryview(big), 3) == len(data) - 3
        assert bytes(big[: len(data) - 3]) == data[3:]


@pytest.mark.parametrize("chunk_size", [10_000, 64 * KiB, 1 << 20])
def test_chunks_in_order(tier: Any, chunk_size: int) -> None:
    data = os.urandom(330 * KiB + 1)
    put(tier, "c.bin", data)
    with tier.open("c.bin") as src:
        sizes, parts = [], []
        for chunk in src.chunks(chunk_size):
            sizes.append(len(chunk))
            parts.append(bytes(chunk))
    assert b"".join(parts) == data
    assert all(s == chunk_size for s in sizes[:-1]) and 0 < sizes[-1] <= chunk_size


def test_chunks_stopped_early(tier: Any) -> None:
    data = os.urandom(400 * KiB)
    put(tier, "c.bin", data)
    with tier.open("c.bin") as src:
        it = src.chunks(16 * KiB)
        assert bytes(next(it)) == data[: 16 * KiB]
        it.close()  # in-flight read-ahead is settled, nothing leaks


def test_empty_file(tier: Any) -> None:
    pub = put(tier, "empty", b"")
    assert pub.size == 0 and pub.checksum == checksum(b"")
    assert tier.read_bytes("empty") == b""
    with tier.open("empty") as src:
        assert list(src.chunks(4096)) == []
        assert src.readinto(memoryview(bytearray(10)), 0) == 0


def test_stat_and_open_of_missing_and_invalid(tier: Any) -> None:
    assert tier.stat("nope") is None
    assert tier.stat("a/../b") is None
    with pytest.raises(FileNotFound):
        tier.open("nope")
    for bad in ["/abs", "../up", "a//b", "x.tierd-tmp"]:
        with pytest.raises(InvalidPath):
            tier.open(bad)
        with pytest.raises(InvalidPath):
            tier.writer(bad)


def test_walk_lists_published_files_and_skips_temps(tier: Any) -> None:
    put(tier, "a/b/one.bin", b"1" * 100)
    put(tier, "two.bin", b"22")
    with tier.writer("a/three.bin", temp_stem="f3.i1") as open_writer:
        open_writer.write(b"333")
        open_writer.sync()
        entries = {e.relpath: e for e in tier.walk()}
    assert set(entries) == {"a/b/one.bin", "two.bin"}
    assert entries["a/b/one.bin"].size == 100 and entries["two.bin"].size == 2
    assert all(e.mtime_ns > 0 for e in entries.values())
    st = tier.stat("two.bin")
    assert entries["two.bin"].etag in (None, st.version)  # a backend with ETags lists them
    assert entries["two.bin"].mtime_ns == st.mtime_ns


def test_abort_and_unpublished_writers_leave_nothing(tier: Any) -> None:
    w = tier.writer("gone.bin")
    w.write(b"x" * 1000)
    w.abort()
    w.abort()  # idempotent
    with tier.writer("gone2.bin") as w2:
        w2.write(b"y" * 1000)  # leaving the block without publish discards it
    assert tier.stat("gone.bin") is None and tier.stat("gone2.bin") is None
    assert list(tier.walk()) == [] and list(tier.temps()) == []
    with pytest.raises(TierdError):
        w.write(b"z")


def test_sync_then_publish(tier: Any) -> None:
    with tier.writer("s.bin") as w:
        assert w.synced is None
        w.write(b"abc" * 1000)
        st = w.sync()
        assert st.size == 3000 and w.synced == st
        assert w.sync() == st  # idempotent
        pub = w.publish()
    assert pub.size == 3000 and tier.read_bytes("s.bin") == b"abc" * 1000
    with pytest.raises(TierdError):
        w.write(b"more")


def test_no_clobber(tier: Any) -> None:
    put(tier, "x.bin", b"first")
    with pytest.raises(AlreadyExists):
        tier.writer("x.bin")
    # A name that appears while a writer is open is not clobbered at publish.
    with tier.writer("y.bin") as w:
        w.write(b"mine")
        put(tier, "y.bin", b"theirs")
        with pytest.raises(AlreadyExists):
            w.publish()
    assert tier.read_bytes("y.bin") == b"theirs"
    assert tier.read_bytes("x.bin") == b"first"
    assert list(tier.temps()) == []


def test_overwrite_replaces(tier: Any) -> None:
    old = put(tier, "o.bin", b"old" * 100)
    new = put(tier, "o.bin", b"new" * 200, overwrite=True)
    assert tier.read_bytes("o.bin") == b"new" * 200
    assert new.stat.version != old.stat.version
    assert tier.stat("o.bin").version == new.stat.version


def test_limit_is_enforced(tier: Any) -> None:
    with tier.writer("l.bin", limit=100) as w:
        w.write(b"x" * 60)
        with pytest.raises(InsufficientSpace):
            w.write(b"x" * 50)
    assert tier.stat("l.bin") is None


def test_remove_only_the_version_given(tier: Any) -> None:
    first = put(tier, "m.bin", b"one")
    second = put(tier, "m.bin", b"two!", overwrite=True)
    assert not tier.remove("m.bin", version=first.stat.version)
    assert tier.read_bytes("m.bin") == b"two!"
    calls: list[bool] = []
    assert tier.remove("m.bin", version=second.stat.version, between=lambda: calls.append(True))
    assert calls == [True] and tier.stat("m.bin") is None
    assert not tier.remove("m.bin")
    put(tier, "n.bin", b"n")
    assert tier.remove("n.bin") and tier.stat("n.bin") is None


def test_remove_temp_after_an_unfinished_writer(tier: Any) -> None:
    """A writer that never finished (its process died) leaves a temp that recovery finds and
    removes by the final name and the stem; the final name never appears."""
    w = tier.writer("x/y.bin", temp_stem="f1.i1")
    w.write(os.urandom(150 * KiB))
    w.sync()
    found = list(tier.temps())
    assert len(found) == 1 and found[0][0].rsplit("/", 1)[0] == "x"
    assert found[0][1] in ("f1.i1", "")
    assert tier.remove_temp("x/y.bin", "f1.i1")
    assert list(tier.temps()) == []
    assert not tier.remove_temp("x/y.bin", "f1.i1")
    assert tier.stat("x/y.bin") is None
    w.abort()  # what the dead writer would have done: harmless now


def test_temps_feed_remove_temp(tier: Any) -> None:
    """The orphan sweep: every (relpath, stem) that temps() gives can be passed to
    remove_temp(), after which none is left."""
    writers: list[Any] = []
    for name in ("p/one.bin", "two.bin"):
        w = tier.writer(name, temp_stem=f"s-{len(writers)}")
        w.write(b"t" * 5000)
        w.sync()
        writers.append(w)
    found = list(tier.temps())
    assert len(found) == 2
    for relpath, stem in found:
        assert tier.remove_temp(relpath, stem)
    assert list(tier.temps()) == []
    for w in writers:
        w.abort()


def test_probe(tier: Any) -> None:
    data = os.urandom(90 * KiB)
    pub = put(tier, "p.bin", data)
    got = tier.probe("p.bin")
    assert got is not None
    assert got[0] == checksum(data) and got[1].version == pub.stat.version
    assert tier.probe("missing.bin") is None


def test_unchanged_after_replace(tier: Any) -> None:
    put(tier, "u.bin", b"version one")
    with tier.open("u.bin") as src:
        assert src.unchanged()
        put(tier, "u.bin", b"version two", overwrite=True)
        assert not src.unchanged()
    with tier.open("u.bin") as src:
        tier.remove("u.bin")
        assert not src.unchanged()


def test_space_and_location(tier: Any) -> None:
    space = tier.space()
    assert space.free > 0
    assert tier.location and isinstance(tier.location, str)


def test_walk_is_in_relpath_order(tier: Any) -> None:
    """Scan merges every tier's walk with the catalog, so each walk comes in relpath (code
    point) order: a directory sorts where its files' relpaths do (``a.b`` < ``a/b`` < ``a0``)."""
    names = ["a0", "a/b", "a.b", "a/c/d", "a-z/x", "b", "A", "a/\u00e9", "a/z", "\u4e2d/1"]
    for name in names:
        put(tier, name, name.encode())
    walked = [e.relpath for e in tier.walk()]
    assert walked == sorted(names)
    assert next(iter(tier.walk())).relpath == "A"  # lazily: the first without the rest


def test_writer_refuses_bytes_that_are_not_the_checksum_given(tier: Any) -> None:
    data = os.urandom(70 * KiB)
    with tier.writer("k.bin", checksum=checksum(b"other bytes")) as w:
        w.write(data)
        with pytest.raises(IntegrityError):
            w.publish()
    assert tier.stat("k.bin") is None and list(tier.temps()) == []
    pub = put(tier, "k.bin", data, checksum=checksum(data))
    assert pub.checksum == checksum(data) and tier.read_bytes("k.bin") == data
    assert tier.stat("k.bin").checksum in (None, checksum(data))  # stored where it can be


def test_capabilities_are_what_the_tier_does(tier: Any) -> None:
    """Callers ask the capabilities, never the backend: each one is kept."""
    caps = tier.capabilities
    put(tier, "f.bin", b"local or not")
    with tier.open("f.bin") as src:
        local = src.local_file()
        assert (local is not None) == caps.local_files
        if local is not None:
            assert os.pread(local.fd, 5, 0) == b"local"
            assert os.path.samefile(local.path, os.readlink(f"/proc/self/fd/{local.fd}"))
    assert (tier.watch_root() is not None) == caps.local_files
    assert not (caps.shared and caps.holds_copies)  # an origin's copies live elsewhere
    assert caps.direct_gpu <= caps.local_files  # cuFile reads local files only
    if caps.pinned_reads:
        # Every read is conditional on the version opened: a changed file fails, not mixes.
        st = tier.stat("f.bin")
        put(tier, "f.bin", b"changed", overwrite=True)
        with pytest.raises(TierdError), tier.open("f.bin", etag=st.version, known=st) as src:
            src.readinto(memoryview(bytearray(4)), 0)


def test_copies_area_of_a_tier_that_holds_copies(tier: Any) -> None:
    if not tier.capabilities.holds_copies:
        with pytest.raises(TierdError):
            tier.copies()
        return
    area = tier.copies()
    area.check()
    with area.writer("7.1") as w:
        w.write(b"copy")
        w.publish()
    assert area.read_bytes("7.1") == b"copy" and [e.relpath for e in area.walk()] == ["7.1"]
    # A copy is never a file of the tier, nor one of its temps.
    assert list(tier.walk()) == [] and list(tier.temps()) == []
    assert area.remove("7.1") and list(area.walk()) == []


def test_positional_writes_where_copies_are_filled(tier: Any) -> None:
    """A fill lands pieces out of order (write_at), relays them from the temp (read_at), and
    publishes only bytes of the checksum given; a backend that writes in order refuses."""
    data = os.urandom(3 * 100 * KiB + 9)
    pieces = [(o, data[o : o + 100 * KiB]) for o in range(0, len(data), 100 * KiB)]
    if not tier.capabilities.holds_copies:
        with tier.writer("p.bin") as w, pytest.raises(TierdError):
            w.write_at(0, b"x")
        return
    area = tier.copies()
    area.check()
    with area.writer("9.1", checksum=checksum(data)) as w:
        for offset, piece in reversed(pieces):
            w.write_at(offset, piece)
        assert w.read_at(100 * KiB, 10) == data[100 * KiB : 100 * KiB + 10]
        with pytest.raises(TierdError):
            w.write(b"in order after positional writes")
        assert w.publish().checksum == checksum(data)
    assert area.read_bytes("9.1") == data
    with area.writer("9.2", checksum=checksum(data)) as w:
        w.write_at(0, data[:-1] + bytes([data[-1] ^ 1]))  # one bit off (b"\0" was 1/256 same)
        with pytest.raises(IntegrityError):
            w.publish()
    assert [e.relpath for e in area.walk()] == ["9.1"] and list(area.temps()) == []
