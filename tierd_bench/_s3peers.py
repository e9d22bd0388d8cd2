"""What tierd's object-store paths are measured against: the host's ceilings and other clients.

- ceilings: one connection's GET rate, a local copy with fsync (what a promotion's writes
  can reach), and on a GPU the pinned host → device copy;
- promotion (object → file): boto3 ``download_file`` over a sweep of TransferConfigs (the best
  is the reference), obstore ``get`` (one stream) and parallel ranged GETs, s3fs ``get``;
- demotion (file → object): boto3 ``upload_file`` over the same sweep.

The load peers (object → memory) are :mod:`._objload`'s.

Every file a peer writes is fsynced before its clock stops, as tierd's promotions are. A peer
that is not installed gets a row with no figure and says so.
"""

from __future__ import annotations

import asyncio
import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tiering.checksum import Hasher
from tiering.tiers import start_writeback

from ._measure import MiB, frees_gpu, gbps
from ._objrun import (
    PART,
    SWEEP,
    ObjRun,
    checksum_of_array,
    checksum_of_file,
    fsync_path,
)
from ._report import BenchRow

__all__ = [
    "SWEEP",
    "Target",
    "ceilings",
    "demote_peers",
    "get_into",
    "object_checksum",
    "obstore_ranges",
    "obstore_store",
    "parts",
    "promote_peers",
    "s3fs_of",
]


def parts(size: int, part: int = PART) -> list[tuple[int, int]]:
    return [(o, min(part, size - o)) for o in range(0, size, part)]


def object_checksum(run: ObjRun, key: str) -> str:
    """The checksum of an object's bytes as the origin serves them (one plain GET)."""
    client = run.origin.client(pool=2)
    body = client.get_object(Bucket=run.origin.bucket, Key=key)["Body"]
    h = Hasher()
    try:
        while chunk := body.read(8 * MiB):
            h.update(chunk)
    finally:
        body.close()
    return h.value()


def get_into(client: Any, run: ObjRun, view: memoryview, start: int) -> None:
    """One ranged GET streamed straight into ``view`` (boto3 by hand)."""
    end = start + len(view) - 1
    rng = f"bytes={start}-{end}"
    body = client.get_object(Bucket=run.origin.bucket, Key=run.key, Range=rng)["Body"]
    pos = 0
    try:
        while pos < len(view):
            got = body.readinto(view[pos:])
            if not got:
                raise ConnectionError(f"GET bytes={start}-{end} ended early")
            pos += got
    finally:
        body.close()


class Target:
    """Where a load peer puts the object: host memory (pinned, on a GPU), then one copy to the
    device. Cleared before each run, so a read that wrote nothing cannot pass the check."""

    def __init__(self, run: ObjRun) -> None:
        self.dev: Any = None
        self._pinned: Any = None
        if run.cuda:
            cp = importlib.import_module("cupy")
            self._pinned = cp.cuda.alloc_pinned_memory(run.size)
            self.host = np.frombuffer(self._pinned, np.uint8, run.size)
            self.dev = cp.empty(run.size, cp.uint8)
        else:
            self.host = np.empty(run.size, np.uint8)
        self.view = self.host.data

    def clear(self) -> None:
        self.host.fill(0)
        if self.dev is not None:
            self.dev.fill(0)

    def done(self) -> Any:
        if self.dev is not None:
            self.dev.set(self.host)
            return self.dev
        return self.host


# -- ceilings --------------------------------------------------------------------------------
@frees_gpu
def ceilings(run: ObjRun) -> None:
    """One connection's GET, a local copy + fsync, and the pinned host → device copy."""
    run.say("ceilings")
    client = run.origin.client(pool=2)
    target = Target(run)

    def one() -> Any:
        get_into(client, run, target.view, 0)
        return target.host

    t, cpu = run.timed(
        one,
        lambda buf: run.check("one-connection GET", checksum_of_array(buf)),
        before=target.clear,
    )
    run.rate_row("ceil_one_conn", "one connection GET (boto3) into host memory", t, cpu)
    dest = run.work / "ceil-copy.bin"

    data = np.fromfile(run.source, dtype=np.uint8)  # off the clock: the disk's rate alone

    def write() -> Path:
        # As a directory writer writes: 8 MiB writes, writeback started as they go, one fsync.
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for off in range(0, data.size, 8 * MiB):
                _pwrite_all(fd, data[off : off + 8 * MiB], off)
                start_writeback(fd, off, min(8 * MiB, data.size - off))
            os.fsync(fd)
        finally:
            os.close(fd)
        return dest

    t, _ = run.timed(write, lambda p: _file_done(run, "local write", p))
    label = "local write + fsync from memory into the nvme dir (the disk's rate)"
    run.rate_row("ceil_local_write", label, t)
    if run.cuda:
        t, _ = run.timed(target.done, lambda _: None, repeats=max(5, run.repeats))
        run.rate_row("ceil_pinned_h2d", "pinned host -> device copy", t)


def _file_done(run: ObjRun, what: str, path: Path) -> None:
    try:
        run.check(what, checksum_of_file(path))
    finally:
        path.unlink(missing_ok=True)


# -- promotion: object -> local file ---------------------------------------------------------
def promote_peers(run: ObjRun) -> None:
    run.say("promotion peers: object -> local file")
    dest = run.work / "peer.bin"
    _boto3_sweep(run, "promote", "download_file", lambda c, m: _download(run, dest, c, m))
    _obstore_promote(run, dest)
    _s3fs_promote(run, dest)


def _transfer_config(conc: int, chunk_mib: int) -> Any:
    from boto3.s3.transfer import TransferConfig

    chunk = chunk_mib * MiB
    return TransferConfig(
        multipart_threshold=chunk, multipart_chunksize=chunk, max_concurrency=conc
    )


def _download(run: ObjRun, dest: Path, conc: int, chunk_mib: int) -> Callable[[], Path]:
    client, cfg = run.origin.client(pool=conc), _transfer_config(conc, chunk_mib)

    def fn() -> Path:
        client.download_file(run.origin.bucket, run.key, str(dest), Config=cfg)
        fsync_path(dest)
        return dest

    return fn


def _boto3_sweep(
    run: ObjRun, kind: str, verb: str, make: Callable[[int, int], Callable[[], Any]]
) -> None:
    """Each TransferConfig of the run's sweep once (:data:`SWEEP` unless the run names its
    connections), then the best one's median: ``{kind}_boto3``."""
    check = _upload_done(run) if kind == "demote" else lambda p: _file_done(run, verb, p)
    single: dict[tuple[int, int], float] = {}
    for i, (conc, chunk) in enumerate(run.sweep):
        t, _ = run.timed(make(conc, chunk), check, repeats=1, warmup=1 if i == 0 else 0)
        single[conc, chunk] = t
        run.add(
            BenchRow(
                f"{kind}_boto3_{conc}x{chunk}",
                f"  boto3 {verb}, {conc} x {chunk} MiB",
                gbps(run.size, t),
                "GB/s",
                note="(one run)",
            )
        )
    conc, chunk = min(single, key=lambda k: single[k])
    t, cpu = run.timed(make(conc, chunk), check, warmup=0)
    run.rate_row(
        f"{kind}_boto3",
        f"boto3 {verb}, best TransferConfig ({conc} x {chunk} MiB)",
        t,
        cpu,
    )


def obstore_store(run: ObjRun) -> Any:
    store = importlib.import_module("obstore.store")
    kwargs: dict[str, Any] = {
        "endpoint": run.origin.endpoint,
        "virtual_hosted_style_request": False,
        "client_options": {"allow_http": True, "timeout": "300s"},
    }
    if run.origin.nginx:
        kwargs["skip_signature"] = True
    return store.S3Store(run.origin.bucket, **kwargs)


def obstore_ranges(obs: Any, store: Any, run: ObjRun, sink: Callable[[int, Any], None]) -> None:
    """obstore's async ranged GETs, the run's connections in flight, each handed to
    ``sink(offset, bytes)``."""

    async def all_parts() -> None:
        sem = asyncio.Semaphore(run.conns)

        async def one(start: int, n: int) -> None:
            async with sem:
                data = await obs.get_range_async(store, run.key, start=start, length=n)
            sink(start, data)

        await asyncio.gather(*(one(s, n) for s, n in parts(run.size)))

    asyncio.run(all_parts())


def _obstore_promote(run: ObjRun, dest: Path) -> None:
    try:
        obs = importlib.import_module("obstore")
    except ImportError:
        for key, label in (("get", "get"), ("ranges", "ranged GETs")):
            run.missing(f"promote_obstore_{key}", f"obstore {label} -> file", "not installed")
        return
    store = obstore_store(run)

    def get() -> Path:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for chunk in obs.get(store, run.key).stream(min_chunk_size=8 * MiB):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        return dest

    t, cpu = run.timed(get, lambda p: _file_done(run, "obstore get", p))
    run.rate_row("promote_obstore_get", "obstore get (one stream) -> file", t, cpu)

    def ranges() -> Path:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            obstore_ranges(obs, store, run, lambda off, data: _pwrite_all(fd, data, off))
            os.fsync(fd)
        finally:
            os.close(fd)
        return dest

    t, cpu = run.timed(ranges, lambda p: _file_done(run, "obstore ranged GETs", p))
    run.rate_row(
        "promote_obstore_ranges",
        f"obstore async ranged GETs ({run.conns} x {PART // MiB} MiB) -> file",
        t,
        cpu,
    )


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def s3fs_of(run: ObjRun) -> Any:
    s3fs = importlib.import_module("s3fs")
    return s3fs.S3FileSystem(
        anon=run.origin.nginx,
        endpoint_url=run.origin.endpoint,
        config_kwargs={"s3": {"addressing_style": "path"}},
        skip_instance_cache=True,
    )


def _s3fs_promote(run: ObjRun, dest: Path) -> None:
    try:
        fs = s3fs_of(run)
    except ImportError:
        run.missing("promote_s3fs", "s3fs get -> file", "not installed (pip install s3fs)")
        return

    def get() -> Path:
        fs.get(f"{run.origin.bucket}/{run.key}", str(dest))
        fsync_path(dest)
        return dest

    t, cpu = run.timed(get, lambda p: _file_done(run, "s3fs get", p))
    run.rate_row("promote_s3fs", "s3fs get -> file", t, cpu)


# -- demotion: local file -> object ------------------------------------------------------------
def _upload_done(run: ObjRun) -> Callable[[str], None]:
    def check(key: str) -> None:
        try:
            run.check(f"upload to {key}", object_checksum(run, key))
        finally:
            run.origin.client(pool=2).delete_object(Bucket=run.origin.bucket, Key=key)

    return check


def demote_peers(run: ObjRun) -> None:
    run.say("demotion peers: local file -> object")
    key = f"{run.prefix}/peer-upload.bin"

    def make(conc: int, chunk: int) -> Callable[[], str]:
        client, cfg = run.origin.client(pool=conc), _transfer_config(conc, chunk)

        def fn() -> str:
            client.upload_file(str(run.source), run.origin.bucket, key, Config=cfg)
            return key

        return fn

    _boto3_sweep(run, "demote", "upload_file", make)
