"""Prefetch: background jobs that warm files up into GPU leases, the memory tier, the fastest
tier or the page cache, with progress in bytes and files and cancellation between chunks.

Files on an object-store tier load into GPU leases like any other (ranged reads, no local
copy). ``nvme`` promotes them to the fastest tier through the mover (parallel ranged GETs into
a temp file, hashed, published). ``page_cache`` has no cache to warm for an object: such a
file is promoted to the nearest faster local tier instead (see :func:`_prefetch_page_cache`).
On a catalog several hosts share, the object store is the fleet's origin and both targets
make a copy on this host's tier instead of a move (see :mod:`tiering.copies.hostcopies`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence

from tiering.catalog import FileRecord
from tiering.errors import InvalidInput, TierdError, TooLarge
from tiering.io import Device, IoReport
from tiering.io.buffers import alloc_size
from tiering.moves import Cancelled
from tiering.serving.config import FileRef, MiB
from tiering.serving.context import LoadContext
from tiering.serving.jobs import Job, JobCancelled, JobTable
from tiering.serving.leases import LeaseSpec
from tiering.tiers import FillCancelled, Tier

__all__ = ["PREFETCH_TARGETS", "start_prefetch"]

PREFETCH_TARGETS = ("gpu", "memory", "nvme", "page_cache")


def start_prefetch(
    ctx: LoadContext,
    jobs: JobTable,
    files: Sequence[FileRef],
    *,
    target: str,
    device: str | Device | None,
    ttl_s: float | None,
) -> Job:
    """Start a warm-up job on ``jobs``; see :meth:`tiering.serving.Loader.prefetch`."""
    if target not in PREFETCH_TARGETS:
        raise InvalidInput(f"target must be one of {', '.join(PREFETCH_TARGETS)}, got {target!r}")
    if not files:
        raise InvalidInput("name at least one file")
    if len(files) > ctx.config.max_batch_items:
        raise TooLarge(
            f"{len(files)} files is over the limit of {ctx.config.max_batch_items}",
            limit=ctx.config.max_batch_items,
        )
    recs: dict[int, FileRecord] = {}
    for ref in files:
        rec = ctx.record(ref)
        recs.setdefault(rec.id, rec)
    todo = list(recs.values())
    dev: Device | None = None
    if target == "gpu":
        dev = ctx.device(device or "cuda:0")
        ctx.leases.ttl(ttl_s)
    elif device is not None:
        raise InvalidInput(f"device applies to target gpu only, not {target}")
    keep_s = 0.0
    if target == "memory":
        if ctx.engine.memory is None:
            raise InvalidInput(
                'target memory needs a memory tier: configure one ([[tiers]] kind = "memory" '
                "with quota_bytes, listed first)"
            )
        keep_s = ctx.leases.ttl(ttl_s)
    job = Job(
        id="",
        kind="prefetch",
        target=target,
        files_total=len(todo),
        bytes_total=sum(r.size for r in todo),
        device=str(dev) if dev else None,
    )
    if target == "gpu":
        assert dev is not None
        gpu_dev = dev
        return jobs.submit(
            job,
            lambda j: _prefetch_gpu(ctx, j, todo, gpu_dev, ttl_s),
            lambda j: _prefetch_cleanup(ctx, j),
        )
    if target == "memory":
        return jobs.submit(job, lambda j: _prefetch_memory(ctx, j, todo, keep_s))
    if target == "nvme":
        return jobs.submit(job, lambda j: _prefetch_nvme(ctx, j, todo))
    return jobs.submit(job, lambda j: _prefetch_page_cache(ctx, j, todo))


def _prefetch_cleanup(ctx: LoadContext, job: Job) -> None:
    # Cancelled: the warm leases are not wanted. Failed: keep the ones that loaded.
    if job.cancel.is_set():
        with job.lock:
            ids, job.lease_ids = job.lease_ids, []
        ctx.leases.release_many(ids)


def _file_error(job: Job, rec: FileRecord, exc: TierdError) -> None:
    with job.lock:
        job.errors.append(
            {"file_id": rec.id, "path": rec.relpath, "code": exc.code, "message": exc.message}
        )


def _prefetch_gpu(
    ctx: LoadContext, job: Job, recs: list[FileRecord], dev: Device, ttl_s: float | None
) -> None:
    # Every warm buffer is a read-only resident copy (see serving.residency): a shared load of
    # the file is handed the same allocation, other loads copy from it, and a file that is
    # resident on the device already is handed out again instead of read.
    storage = ctx.storage(dev)
    chunk = ctx.config.prefetch_chunk_bytes
    residency = ctx.residency
    for rec in recs:
        job.check()
        try:
            cur = ctx.engine.catalog.get(rec.id, cached=True)
            tier = ctx.engine.tiers.get(cur.tier)
            key = residency.whole(cur, dev)
            with residency.claim([key]):
                entry = residency.find(key, cur, tier)
                lease = None
                if entry is not None:
                    lease = residency.grant_shared(entry, cur, kind="prefetch", ttl_s=ttl_s)
                if lease is not None:
                    job.add(nbytes=lease.nbytes)
                else:
                    stat = residency.stat_now(cur, tier)  # before the read, as a copy needs
                    with ctx.open(cur.id, storage) as (f, file_id):
                        n = f.size()
                        with ctx.leases.reserve(dev, alloc_size(dev, n)) as res:
                            buf = res.attach(ctx.leases.pool.get(dev, n))
                            arr = buf.array()
                            storage.device.make_current()
                            started = time.perf_counter()
                            parts: list[IoReport] = []
                            pos = 0
                            while pos < n:
                                job.check()
                                k = min(chunk, n - pos)
                                parts.append(storage.load_to_gpu(f, pos, arr[pos : pos + k]))
                                pos += k
                                job.add(nbytes=k)
                            del arr
                            buf.synchronize()
                            # Where the bytes came from: the slowest of the chunks' sources.
                            slow = next((p for p in parts if p.cold), parts[0] if parts else None)
                            report = IoReport(
                                n,
                                f.io_path,
                                f.tier_key,
                                time.perf_counter() - started,
                                slow.cold if slow else False,
                                source=slow.source if slow else "page_cache",
                            )
                            spec = LeaseSpec(
                                n, "uint8", (n,), "prefetch", (file_id,), report, ttl_s
                            )
                            lease = ctx.leases.grant(res, spec, read_only=True)
                    if stat is not None:
                        residency.register(key, lease, stat)
        except TierdError as exc:
            _file_error(job, rec, exc)
            continue
        with job.lock:
            job.lease_ids.append(lease.id)
            job.files_done += 1
        assert lease.report is not None
        ctx.observe("prefetch", dev, lease.report)


def _promote(ctx: LoadContext, job: Job, rec: FileRecord, to_tier: str) -> None:
    """Move ``rec`` to ``to_tier`` through the mover (one access counted), its copied bytes
    reported as the job's progress; a file already there is done at once. A fleet's origin
    file (see :mod:`tiering.copies.hostcopies`) is copied there instead, kept at least
    the lease TTL whatever its heat."""
    base = job.bytes_done
    hc = ctx.engine.host_copies
    try:
        if ctx.engine.access is not None:
            ctx.engine.access.record(rec.id)
        cur = ctx.engine.get(rec.id)
        if hc is not None and hc.is_origin(cur.tier):

            def added(n: int) -> None:
                job.add(nbytes=n)

            hc.fill(
                rec.id,
                to_tier,
                cancel=job.cancel,
                progress=added,
                keep_s=ctx.leases.ttl(None),
                sources=job.add_source,
            )
        elif cur.tier != to_tier:

            def progress(done: int, _total: int, base: int = base) -> None:
                with job.lock:
                    job.bytes_done = base + done

            ctx.engine.mover.migrate(
                rec.id, to_tier, reason="prefetch", progress=progress, cancel=job.cancel
            )
    except Cancelled as exc:
        if job.cancel.is_set():
            raise JobCancelled from exc
        _file_error(job, rec, exc)
    except FillCancelled as exc:
        raise JobCancelled from exc
    except TierdError as exc:
        _file_error(job, rec, exc)
    with job.lock:
        job.bytes_done = base + rec.size
        job.files_done += 1


def _prefetch_nvme(ctx: LoadContext, job: Job, recs: list[FileRecord]) -> None:
    fastest = ctx.engine.tiers.fastest
    if ctx.engine.host_copies is not None and not fastest.capabilities.holds_copies:
        # An origin cannot take a copy: a fleet's fastest copy goes to its fastest own tier.
        holders = (t for t in ctx.engine.tiers if t.capabilities.holds_copies)
        fastest = next(holders, fastest)
    for rec in recs:
        job.check()
        _promote(ctx, job, rec, fastest.name)


def _local_cache_tier(ctx: LoadContext, tier: Tier) -> str | None:
    """The slowest tier of local files faster than ``tier``: where a file of a remote tier is
    warmed to, or None when no local tier is faster."""
    faster = [t for t in ctx.engine.tiers if t.capabilities.local_files and t.rank < tier.rank]
    return max(faster, key=lambda t: t.rank).name if faster else None


def _prefetch_page_cache(ctx: LoadContext, job: Job, recs: list[FileRecord]) -> None:
    """Read local files through the page cache. A file on a remote tier (an object store)
    has no page cache to warm: it is promoted to the nearest faster local tier instead, so the
    next load reads a local disk (whose page cache the copy has just filled)."""
    chunk = min(ctx.config.prefetch_chunk_bytes, 8 * MiB)
    view = memoryview(bytearray(chunk))
    for rec in recs:
        job.check()
        tier = ctx.engine.tiers.get(rec.tier)
        if not tier.capabilities.local_files:
            dest = _local_cache_tier(ctx, tier)
            if dest is None:
                msg = (
                    f"{rec.relpath!r} is on tier {tier.name}, whose files are not local (no "
                    "page cache), and no local tier is faster to warm it to"
                )
                _file_error(job, rec, InvalidInput(msg, path=rec.relpath))
                job.add(nbytes=rec.size, files=1)
            else:
                _promote(ctx, job, rec, dest)
            continue
        try:
            content = ctx.engine.open_content(rec.id)
        except TierdError as exc:
            _file_error(job, rec, exc)
            continue
        try:
            # A compressed file's container is what its reads go through the page cache for.
            local = content.source.stored_file()
            assert local is not None  # a tier of local files opens them as such
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(local.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            stored, pos = os.fstat(local.fd).st_size, 0
            while pos < stored:
                job.check()
                got = os.preadv(local.fd, [view[: min(chunk, stored - pos)]], pos)
                if got <= 0:
                    break
                pos += got
                job.add(nbytes=got * content.size // max(stored, 1))  # the file's bytes warmed
        finally:
            content.close()
        job.add(files=1)


def _prefetch_memory(ctx: LoadContext, job: Job, recs: list[FileRecord], keep_s: float) -> None:
    """Copy each file into the memory tier (one access counted each), kept there ``keep_s``
    whatever its heat; a file already there is done at once. A file that does not fit (the
    copies there are hotter, or host memory is low) is the job's error for that file. On a
    fleet, a shared file comes through this host's copy on disk, made from the pieces the
    hosts exchange (see :mod:`tiering.copies.fillsource`): the job's ``sources`` say whose."""
    memory = ctx.engine.memory
    assert memory is not None
    for rec in recs:
        job.check()
        base = job.bytes_done

        def progress(n: int) -> None:
            job.add(nbytes=n)

        try:
            if ctx.engine.access is not None:
                ctx.engine.access.record(rec.id)
            memory.fill(
                rec.id,
                cancel=job.cancel,
                progress=progress,
                keep_s=keep_s,
                sources=job.add_source,  # a shared file's: its pieces' (see copies.fillsource)
            )
        except FillCancelled as exc:
            raise JobCancelled from exc
        except TierdError as exc:
            _file_error(job, rec, exc)
        with job.lock:
            job.bytes_done = base + rec.size
            job.files_done += 1
