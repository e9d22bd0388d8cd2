"""A file's generation counts changes of its content, on both backends: the same published bytes
recorded twice (a scan that listed a file just before its upload committed, as CI once caught)
leave it as it was; new bytes, or the same bytes published again, bump it."""

from __future__ import annotations

from tiering.catalog import NewFile
from tiering.engine import Engine


def test_recording_the_same_bytes_twice_keeps_the_generation(eng: Engine) -> None:
    same = NewFile("a.bin", "nvme", 5, 1_000, "xxh3_128:" + "c" * 32)
    [first] = eng.catalog.upsert_many([same])
    assert first is not None and first.generation == 0
    [again] = eng.catalog.upsert_many([same])
    assert again is not None and (again.id, again.generation) == (first.id, 0)
    # Published again (a new mtime), even with the same bytes: a new generation.
    [republished] = eng.catalog.upsert_many([NewFile("a.bin", "nvme", 5, 2_000, same.checksum)])
    assert republished is not None and republished.generation == 1
    [changed] = eng.catalog.upsert_many(
        [NewFile("a.bin", "nvme", 6, 2_000, "xxh3_128:" + "d" * 32)]
    )
    assert changed is not None and changed.generation == 2
    # Without a checksum or an ETag nothing says the bytes are the same: a new generation.
    eng.catalog.upsert_many([NewFile("b.bin", "nvme", 1, 1, None)])
    [b] = eng.catalog.upsert_many([NewFile("b.bin", "nvme", 1, 1, None)])
    assert b is not None and b.generation == 1
