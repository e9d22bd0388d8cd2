"""Loads of files on an object-store tier (a real S3 server, moto, over HTTP), without a local
copy first: whole files and ranges, safetensors tensors, gathers of rows and batches into
leases; a changed object refused with FileChanged; prefetch promoting through the mover; and
read-through promotion by heat like any other tier. GPU variants carry the gpu mark."""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save

from tests.conftest import wait_for
from tests.s3 import REGION
from tests.s3_faults import FaultProxy, Rule
from tiering.config import EngineConfig, TierConfig
from tiering.engine import Engine
from tiering.errors import FileChanged
from tiering.io import GdsConfig
from tiering.io.safetensors import parse_header
from tiering.serving import Loader
from tiering.serving.config import LoaderConfig
from tiering.serving.leases import Lease
from tiering.serving.loads import LoadItem

PART = 64 << 10  # bytes of one ranged GET (moto accepts parts this small: tests.s3)
SIZE = 5 * PART + 1234  # several GETs, and several staging pieces on a GPU
IO = GdsConfig(remote_piece_size=96 << 10, remote_pieces=3, remote_threads=4)

DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]


def _engine_config(tmp: Path, bucket: str, endpoint: str) -> EngineConfig:
    """A directory tier above a bucket prefix; the catalog built by Alembic."""
    return EngineConfig(
        tiers=(
            TierConfig("nvme", tmp / "nvme"),
            TierConfig(
                "s3",
                kind="object",
                url=f"s3://{bucket}/models",
                endpoint_url=endpoint,
                region=REGION,
                part_size=PART,
                connections=4,
            ),
        ),
        catalog_url=f"sqlite:///{tmp / 'catalog.db'}",
        watch=False,
        access_flush_interval_s=0.05,
    )


@pytest.fixture
def put_object(s3_client: Any, s3_bucket: str) -> Callable[[str, bytes], None]:
    """``put_object(relpath, data)``: an object under the tier's prefix, behind tierd's back."""

    def put(relpath: str, data: bytes) -> None:
        s3_client.put_object(Bucket=s3_bucket, Key=f"models/{relpath}", Body=data)

    return put


@pytest.fixture
def s3eng(tmp_path: Path, moto_endpoint: str, s3_bucket: str, s3_env: Any) -> Iterator[Engine]:
    with Engine(_engine_config(tmp_path, s3_bucket, moto_endpoint)) as e:
        yield e


@pytest.fixture
def loader(s3eng: Engine) -> Iterator[Loader]:
    ld = Loader(s3eng, LoaderConfig(io=IO, cpu_budget_bytes=64 << 20)).start()
    yield ld
    ld.stop()


@pytest.fixture
def ranges(
    tmp_path: Path, fault_proxy: FaultProxy, s3_bucket: str, s3_env: Any
) -> Iterator[tuple[Loader, list[tuple[int, int]]]]:
    """A loader whose engine reaches the bucket through a proxy that records the byte range
    of every ranged GET it answers: what tierd fetched, on the wire."""
    served: list[tuple[int, int]] = []

    def record(status: int, headers: Any, body: bytes) -> tuple[int, Any, bytes]:
        for k, v in headers:
            if k.lower() == "content-range":  # "bytes first-last/size"
                first, last = v.split()[1].split("/")[0].split("-")
                served.append((int(first), int(last) + 1))
        return status, headers, body

    with fault_proxy.state.lock:
        fault_proxy.state.rules.append(
            Rule("edit", method="GET", header="Range", times=1 << 30, edit=record)
        )
    with Engine(_engine_config(tmp_path, s3_bucket, fault_proxy.url)) as e:
        ld = Loader(e, LoaderConfig(io=IO)).start()
        try:
            yield ld, served
        finally:
            ld.stop()


def _host(arr: Any) -> np.ndarray:
    if hasattr(arr, "__cuda_array_interface__"):
        return importlib.import_module("cupy").asnumpy(arr)  # type: ignore[no-any-return]
    return np.asarray(arr)


def _bytes(lease: Lease) -> bytes:
    arr = lease.buffer.array()[lease.offset : lease.offset + lease.nbytes]
    return _host(arr).tobytes()


def _adopt(eng: Engine, *relpaths: str) -> list[int]:
    report = eng.scan()
    assert set(relpaths) <= set(report.adopted), report
    return [eng.lookup(r).id for r in relpaths]


def _no_local_copy(tmp: Path) -> None:
    assert not any(p.is_file() for p in (tmp / "nvme").rglob("*"))


@pytest.mark.parametrize("device", DEVICES)
def test_whole_files_and_ranges_load_from_the_bucket(
    loader: Loader, s3eng: Engine, put_object: Any, tmp_path: Path, device: str
) -> None:
    data = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    put_object("llama/model.bin", data)
    (fid,) = _adopt(s3eng, "llama/model.bin")
    whole = loader.load(fid, device=device)
    assert _bytes(whole) == data
    assert whole.report is not None
    assert (whole.report.io_path, whole.report.tier, whole.report.nbytes) == ("remote", "s3", SIZE)
    part = loader.load("llama/model.bin", offset=PART - 3, length=2 * PART + 7, device=device)
    assert _bytes(part) == data[PART - 3 : 3 * PART + 4]
    f32 = loader.load(fid, offset=4, length=4000, dtype="float32", shape=[-1, 10], device=device)
    assert f32.shape == (100, 10) and _bytes(f32) == data[4:4004]
    empty = loader.load(fid, offset=SIZE, device=device)
    assert empty.nbytes == 0
    stats = loader.stats()
    assert stats.by_path["remote"].bytes_transferred == SIZE + 2 * PART + 7 + 4000
    assert stats.by_tier["s3"].operations_completed >= 3
    assert "host" not in stats.by_path and "nvme" not in stats.by_tier
    _no_local_copy(tmp_path)  # nothing was downloaded to a local tier first
    for lease in (whole, part, f32, empty):
        loader.leases.release(lease.id)


@pytest.mark.parametrize("device", DEVICES)
def test_safetensors_and_batches_from_the_bucket(
    loader: Loader, s3eng: Engine, put_object: Any, device: str
) -> None:
    rng = np.random.default_rng(2)
    tensors: dict[str, np.ndarray] = {
        "embed": rng.standard_normal((64, 48)).astype(np.float32),
        "norm": rng.standard_normal(48).astype(np.float16),
        "proj": rng.integers(-(2**31), 2**31, (32, 40), dtype=np.int32),
    }
    put_object("m/model.safetensors", save(tensors))
    other = {"head": rng.standard_normal((16, 16)).astype(np.float64)}
    put_object("m/head.safetensors", save(other))
    blob = rng.integers(0, 256, 3 * PART, dtype=np.uint8).tobytes()
    put_object("m/blob.bin", blob)
    ids = _adopt(s3eng, "m/model.safetensors", "m/head.safetensors", "m/blob.bin")
    loaded = loader.load_safetensors(ids[:2], device=device)
    assert sorted(loaded.tensors) == ["embed", "head", "norm", "proj"]
    by_id = {lease.id: lease for lease in loaded.leases}
    for name, want in {**tensors, **other}.items():
        loc = loaded.tensors[name]
        lease = by_id[loc.buffer_id]
        raw = _host(lease.buffer.array()[loc.offset : loc.offset + loc.nbytes])
        assert raw.tobytes() == want.tobytes(), name
        assert lease.report is not None and lease.report.io_path == "remote"
    batch = loader.load_batch(
        [LoadItem(ids[2]), LoadItem("m/blob.bin", offset=5, length=PART)], device=device
    )
    assert [_bytes(b) for b in batch] == [blob, blob[5 : 5 + PART]]
    for lease in [*loaded.leases, *batch]:
        loader.leases.release(lease.id)


def test_a_safetensors_subset_fetches_only_its_tensors(
    ranges: tuple[Loader, list[tuple[int, int]]], put_object: Any
) -> None:
    ld, served = ranges
    rng = np.random.default_rng(3)
    names = [f"layer{i}" for i in range(10)]
    tensors = {n: rng.standard_normal((100, 160)).astype(np.float32) for n in names}
    blob = save(tensors)
    put_object("s/model.safetensors", blob)
    (fid,) = _adopt(ld.engine, "s/model.safetensors")
    hdr = parse_header("model.safetensors", len(blob), lambda n, off: blob[off : off + n])
    served.clear()
    # Two tensors far apart, with eight unwanted ones between them.
    out = ld.load_safetensors([fid], names=["layer0", "layer9"], device="cpu")
    (lease,) = out.leases
    for n in ("layer0", "layer9"):
        loc = out.tensors[n]
        got = np.asarray(lease.buffer.array()[loc.offset : loc.offset + loc.nbytes])
        assert got.tobytes() == tensors[n].tobytes()
    # First the header's read (its first 256 KiB, in parallel GETs), then exactly the wanted
    # tensors' bytes.
    assert len(blob) > 2 * (256 << 10)
    k = next(i for i in range(len(served)) if sum(b - a for a, b in served[: i + 1]) >= 256 << 10)
    assert sorted(served[: k + 1])[0][0] == 0 and max(b for _, b in served[: k + 1]) == 256 << 10
    wanted = sorted((hdr.tensors[n].begin, hdr.tensors[n].end) for n in ("layer0", "layer9"))
    data = sorted(served[k + 1 :])
    assert sum(b - a for a, b in data) == sum(b - a for a, b in wanted)
    assert all(any(w0 <= a and b <= w1 for w0, w1 in wanted) for a, b in data)
    ld.leases.release(lease.id)


@pytest.mark.parametrize("device", DEVICES)
def test_gathers_fetch_only_the_rows_asked_for(
    ranges: tuple[Loader, list[tuple[int, int]]], put_object: Any, device: str
) -> None:
    ld, served = ranges
    dim, rows = 64, 4096  # 256-byte rows, a 1 MiB matrix
    m = np.random.default_rng(4).standard_normal((rows, dim)).astype(np.float32)
    put_object("emb/table.f32", m.tobytes())
    (fid,) = _adopt(ld.engine, "emb/table.f32")
    served.clear()
    idx = [4000, 7, 8, 9, 7, 2048, 0, 4095, 10]
    lease = ld.gather(fid, dim=dim, dtype="float32", indices=idx, device=device)
    assert _bytes(lease) == m[idx].tobytes()
    assert lease.report is not None and lease.report.io_path == "remote"
    fetched = sum(b - a for a, b in served)
    assert 0 < fetched <= 2 * len(set(idx)) * dim * 4  # the rows (and small gaps), not 1 MiB
    sliced = ld.gather(fid, dim=dim, dtype="float32", start=100, count=50, device=device)
    assert _bytes(sliced) == m[100:150].tobytes()
    ld.leases.release(lease.id)
    ld.leases.release(sliced.id)


def test_scattered_rows_through_the_storage_api(
    loader: Loader, s3eng: Engine, put_object: Any
) -> None:
    """A library user's gather of a remote file: rows in random order, with duplicates."""
    dim = 32
    m = np.random.default_rng(5).standard_normal((3000, dim)).astype(np.float32)
    put_object("emb/big.f32", m.tobytes())
    (fid,) = _adopt(s3eng, "emb/big.f32")
    idx = np.random.default_rng(6).integers(0, 3000, 5000)
    storage = loader.storage(loader.device("cpu"))
    content = s3eng.open_content(fid)
    with storage.open_source(content.source, tier="s3", rank=1) as f:
        got = storage.gather(f, idx, dim, np.float32)
        assert got.report.io_path == "remote"
        assert np.array_equal(got.array, m[idx])
        assert np.array_equal(storage.read_vectors(f, 2990, 10, dim).array, m[2990:])


@pytest.mark.parametrize("device", DEVICES)
def test_an_object_changed_behind_tierds_back_is_never_served(
    loader: Loader, s3eng: Engine, put_object: Any, device: str
) -> None:
    data = b"a" * SIZE
    put_object("c/w.bin", data)
    (fid,) = _adopt(s3eng, "c/w.bin")
    # Changed after the catalog recorded it: refused at open.
    put_object("c/w.bin", b"b" * SIZE)
    with pytest.raises(FileChanged, match="changed behind tierd's back") as exc:
        loader.load(fid, device=device)
    assert exc.value.code == "file_changed"
    with pytest.raises(FileChanged):
        loader.gather(fid, dim=2, dtype="uint8", indices=[0, 5], device=device)
    with pytest.raises(FileChanged):
        loader.load_batch([LoadItem(fid)], device=device)
    assert loader.leases.leased_bytes().get(device, 0) == 0  # nothing was served or kept
    # Changed between open and read: every ranged GET carries If-Match.
    put_object("c/w.bin", data)
    s3eng.scan()  # the catalog takes the new ETag
    storage = loader.storage(loader.device(device))
    with storage.open_source(s3eng.open_content(fid).source, tier="s3", rank=1) as f:
        assert _host(storage.read(f, 0, 10).array).tobytes() == data[:10]
        put_object("c/w.bin", b"c" * SIZE)
        with pytest.raises(FileChanged, match="changed behind tierd's back"):
            storage.read(f)
    assert loader.stats().by_path["remote"].operations_failed >= 1


def test_prefetch_promotes_objects_to_local_tiers(
    loader: Loader, s3eng: Engine, put_object: Any, tmp_path: Path
) -> None:
    a, b = b"x" * SIZE, b"y" * (PART + 1)
    put_object("hf/a.bin", a)
    put_object("hf/b.bin", b)
    ids = _adopt(s3eng, "hf/a.bin", "hf/b.bin")
    job = loader.prefetch(ids[:1], target="nvme")
    wait_for(lambda: job.finished, what="the nvme prefetch")
    assert (job.state, job.files_done, job.bytes_done) == ("done", 1, SIZE), job.errors
    assert s3eng.get(ids[0]).tier == "nvme"
    assert (tmp_path / "nvme" / "hf" / "a.bin").read_bytes() == a
    # page_cache: an object has none, so it is promoted to the nearest faster local tier.
    job = loader.prefetch(ids, target="page_cache")
    wait_for(lambda: job.finished, what="the page_cache prefetch")
    assert (job.state, job.files_done, job.bytes_done) == ("done", 2, SIZE + PART + 1), job.errors
    assert s3eng.get(ids[1]).tier == "nvme"
    assert (tmp_path / "nvme" / "hf" / "b.bin").read_bytes() == b
    # gpu (a warm lease on cpu here): straight from the bucket after a demotion.
    s3eng.migrate(ids[1], "s3")
    job = loader.prefetch([ids[1]], target="gpu", device="cpu")
    wait_for(lambda: job.finished, what="the gpu prefetch")
    assert job.state == "done", job.errors
    (lease_id,) = job.lease_ids
    assert _bytes(loader.leases.get(lease_id)) == b
    loader.leases.release(lease_id)


def test_heat_promotes_an_object_like_any_other_tier(
    loader: Loader, s3eng: Engine, put_object: Any
) -> None:
    """Read-through: the default policy's thresholds apply to the object tier as to any
    tier; loads make the file hot, and the plan promotes it to nvme."""
    put_object("hot.bin", b"h" * 4096)
    (fid,) = _adopt(s3eng, "hot.bin")
    s3eng.set_policy(
        {
            "tiers": {"nvme": {"min_heat": 2}, "s3": {"min_heat": 0}},
            "min_age_s": 0,
            "enabled": False,  # the test runs the move itself
        }
    )
    assert s3eng.plan() == []
    for _ in range(3):  # heat ≥ 2 x (1 + 20 % hysteresis)
        loader.leases.release(loader.load(fid).id)
    assert s3eng.access is not None
    s3eng.access.flush()
    (move,) = s3eng.plan()
    assert (move.file_id, move.src, move.dst, move.kind) == (fid, "s3", "nvme", "promote")
    s3eng.migrate(fid, "nvme", reason="policy")
    assert s3eng.get(fid).tier == "nvme"
    assert _bytes(loader.load(fid)) == b"h" * 4096


def test_safetensors_header_of_a_remote_file_is_one_request(
    ranges: tuple[Loader, list[tuple[int, int]]], put_object: Any
) -> None:
    ld, served = ranges
    blob = save({"t": np.arange(10, dtype=np.int64)})
    put_object("one/t.safetensors", blob)
    (fid,) = _adopt(ld.engine, "one/t.safetensors")
    served.clear()
    out = ld.load_safetensors([fid], device="cpu")
    assert np.frombuffer(io.BytesIO(_bytes(out.leases[0])).read(), np.int64).tolist() == list(
        range(10)
    )
    assert served[0] == (0, len(blob))  # the header (here the whole file) in one request
    ld.leases.release(out.leases[0].id)
