"""Access tracking: batched counts, heat decay, flush at shutdown."""

from __future__ import annotations

import math
import threading
import time

import pytest

from tests.conftest import wait_for
from tiering.catalog import decay
from tiering.engine import Engine
from tiering.errors import FileNotFound


def test_decay_halves_per_half_life() -> None:
    assert decay(8.0, 100.0, 100.0, 10.0) == 8.0
    assert decay(8.0, 100.0, 110.0, 10.0) == pytest.approx(4.0)
    assert decay(8.0, 100.0, 130.0, 10.0) == pytest.approx(1.0)
    assert decay(0.0, 0.0, 1e9, 10.0) == 0.0
    assert decay(5.0, 200.0, 100.0, 10.0) == 5.0  # clocks going back never add heat


def test_reads_are_counted_in_batches(client) -> None:
    fid = client.put("/v1/files/content", params={"path": "h.bin"}, content=b"abc").json()["id"]
    for _ in range(10):
        client.get(f"/v1/files/{fid}/content")
    client.get(f"/v1/files/{fid}/content", headers={"Range": "bytes=0-0"})
    wait_for(lambda: client.get(f"/v1/files/{fid}").json()["access_count"] == 11)
    rec = client.get(f"/v1/files/{fid}").json()
    assert 10.9 < rec["heat"] <= 11 and rec["last_access"] is not None
    assert client.get(f"/v1/files/{fid}").json()["access_count"] == 11  # metadata isn't a read


def test_heat_decays_lazily(settings) -> None:
    # Flushed only by the test (the periodic flush, every 0.05 s in tests, would flush the new
    # access at the clock's time before the test's flush at t0 + 2 half-lives).
    slow = settings.model_copy(update={"access_flush_interval_s": 3600})
    with Engine(slow.engine_config()) as engine:
        _decays_lazily(engine)


def _decays_lazily(engine: Engine) -> None:
    up = engine.begin_upload("d.bin")
    up.write(b"x")
    rec = up.commit()
    t0 = time.time()
    engine.access.record(rec.id, 4)
    engine.access.flush(now=t0)
    rec = engine.get(rec.id)
    hl = engine.config.half_life_s
    assert engine.heat(rec, now=t0) == pytest.approx(4)
    assert engine.heat(rec, now=t0 + hl) == pytest.approx(2)
    # New accesses decay the stored heat first, then add.
    engine.access.record(rec.id, 1)
    engine.access.flush(now=t0 + 2 * hl)
    assert engine.get(rec.id).heat == pytest.approx(2.0)
    assert engine.get(rec.id).access_count == 5


def test_counts_survive_shutdown(settings) -> None:
    slow = settings.model_copy(update={"access_flush_interval_s": 3600})
    with Engine(slow.engine_config()) as eng:
        up = eng.begin_upload("s.bin")
        up.write(b"x")
        fid = up.commit().id
        for _ in range(7):
            eng.open_content(fid).close()
    with Engine(slow.engine_config()) as eng:
        assert eng.get(fid).access_count == 7


def test_concurrent_recording_loses_nothing(engine: Engine) -> None:
    up = engine.begin_upload("c.bin")
    up.write(b"x")
    fid = up.commit().id

    def hammer() -> None:
        for _ in range(20_000):
            engine.access.record(fid)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.access.flush()
    assert engine.get(fid).access_count == 80_000
    assert math.isfinite(engine.get(fid).heat)


def test_cached_records_follow_every_change(engine: Engine, data_dir) -> None:
    """The read path's record cache never serves a stale place or content."""
    up = engine.begin_upload("cache.bin", tier="ssd")
    up.write(b"one")
    rec = up.commit()
    assert engine.open_content(rec.id).record.tier == "ssd"  # now cached
    engine.migrate(rec.id, "hdd")
    content = engine.open_content(rec.id)
    assert content.record.tier == "hdd" and b"".join(content.iter_range(0, 3)) == b"one"
    up = engine.begin_upload("cache.bin", overwrite=True)
    up.write(b"two!")
    up.commit()
    content = engine.open_content(rec.id)
    assert content.record.size == 4 and b"".join(content.iter_range(0, 4)) == b"two!"
    assert engine.lookup("cache.bin", cached=True).size == 4
    engine.delete(rec.id)
    with pytest.raises(FileNotFound):
        engine.open_content(rec.id)
    # Access counts do not invalidate it, but they are counted all the same.
    up = engine.begin_upload("hot.bin")
    up.write(b"h")
    hot = up.commit()
    for _ in range(3):
        engine.open_content(hot.id).close()
    engine.access.flush()
    assert engine.get(hot.id).access_count == 3
