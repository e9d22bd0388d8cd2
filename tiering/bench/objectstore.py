"""``tierd bench object-store`` (``tierd bench --object-store``): tierd's object-store tier
against the usual S3 clients, in one run against one origin.

The origin (:mod:`._origin`: ``moto``, nginx as ``s3like`` or ``open``, or a URL) is started on
loopback by the bench and stopped after it. One object of ``size`` bytes is put there; then:

1. **promotion** (object → NVMe): tierd (an engine with a directory tier ``nvme`` and an object
   tier ``s3`` on the origin; the object adopted by scan, then ``engine.migrate(id, "nvme")``)
   against boto3 ``download_file`` (best of a TransferConfig sweep), obstore and s3fs;
2. **demotion** (NVMe → object, writable origins only): ``engine.migrate(id, "s3")`` against
   boto3 ``upload_file`` (best of the same sweep);
3. **loads** (object → host memory or GPU): tierd's :class:`~tiering.serving.Loader` against
   the same clients into host memory then one copy, and KvikIO's ``RemoteFile``;
4. **adoption**: ``engine.scan()`` of ``objects`` tiny objects, objects per second.

Ceilings of the same run sit beside them (:func:`._s3peers.ceilings`). Every figure is a median
of ``repeats`` after a warm-up, and every result's bytes are checked against the source
(:mod:`._objrun`). Ratios compare figures of this one run: moto is a Python server in this
process, so its absolute rates are its own limit, not tierd's.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tiering.config import EngineConfig, TierConfig
from tiering.engine import Engine

from . import _s3peers
from ._datafiles import workdir
from ._measure import GiB, MiB, default_device, format_size, gpu_name
from ._objrun import ObjRun, check_bytes, checksum_of_array, checksum_of_file, write_source
from ._origin import REGION, OriginUnavailable, open_origin
from ._report import BenchRow, Report, describe_device

__all__ = ["TARGETS", "OriginUnavailable", "run"]

#: ``(row, reference row, at least)``: the targets of issue 10's "Measure" table.
TARGETS = (
    ("promote_tierd", "promote_best", 1.0),
    ("demote_tierd", "demote_boto3", 0.9),
    ("load_tierd", "load_best", 1.0),
)
ADOPT_TARGET = 2_000.0  # objects/s
_PROMOTE_PEERS = ("promote_boto3", "promote_obstore_get", "promote_obstore_ranges", "promote_s3fs")
_LOAD_PEERS = ("load_boto3_ranges", "load_obstore_ranges", "load_s3fs", "load_kvikio")


def run(
    size: int = GiB,
    device: str = "auto",
    origin: str = "moto",
    *,
    repeats: int = 3,
    rate: int | None = 100_000_000,
    objects: int = 10_000,
    directory: Path | None = None,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Run every object-store measurement against ``origin`` and return the report.

    The nvme tier, the source file and nginx's served directory go to a temporary directory
    under ``directory`` (default: the current one; keep it off tmpfs), removed afterwards.
    """
    if size < 1 * MiB:
        raise ValueError("size must be at least 1 MiB")
    if repeats < 1 or objects < 1:
        raise ValueError("repeats and objects must be at least 1")
    device = default_device() if device == "auto" else device
    with workdir(directory) as work, open_origin(origin, rate=rate, parent=work, say=say) as org:
        say(f"writing a {format_size(size)} source object")
        source = work / "source.bin"
        expected = write_source(source, size)
        tag = secrets.token_hex(4)
        setup: dict[str, Any] = {
            "device": device,
            "gpu": gpu_name(device),
            "origin": org.kind,
            "origin_description": org.description,
            "endpoint": org.endpoint,
            "bucket": org.bucket,
            "rate_bytes_per_s": org.rate,
            "size_bytes": size,
            "repeats": repeats,
            "objects": objects,
            "directory": str(work),
            "checksum": expected,
            "peer_connections": _s3peers.CONNECTIONS,
            "peer_part_bytes": _s3peers.PART,
            "boto3_sweep": [list(c) for c in _s3peers.SWEEP],
            "cpu_note": "CPU-s/GB is this process's CPU time"
            + (", moto's own included (it runs in this process)" if org.kind == "moto" else ""),
        }
        report = Report(
            "object-store",
            f"tierd bench object-store: origin {org.kind} ({org.description}), "
            f"{describe_device(setup)}, {format_size(size)} object, medians of {repeats}",
            setup,
        )
        objrun = ObjRun(org, size, device, repeats, work, source, expected, say, report,
                        prefix=f"tb-{tag}-model")  # fmt: skip
        adopt_prefix = f"tb-{tag}-adopt"
        try:
            org.put_file(objrun.key, source)
            _s3peers.ceilings(objrun)
            _tierd_moves_and_load(objrun)
            _s3peers.promote_peers(objrun)
            if org.writable:
                _s3peers.demote_peers(objrun)
            else:
                why = f"origin {org.kind} is read-only: demotion needs moto or a URL"
                objrun.missing("demote_boto3", "boto3 upload_file, best TransferConfig", why)
            _s3peers.load_peers(objrun)
            _adoption(objrun, adopt_prefix, objects)
        finally:
            for prefix in (objrun.prefix, adopt_prefix):
                with contextlib.suppress(Exception):
                    org.delete_prefix(prefix)
    _compare(report)
    return report


# -- tierd ----------------------------------------------------------------------------------
@contextlib.contextmanager
def _engine(run: ObjRun, prefix: str) -> Iterator[Engine]:
    """A fresh engine: directory tier ``nvme`` in the work dir, object tier ``s3`` on the
    origin at ``s3://bucket/prefix``; no watcher, no scheduler, no bandwidth cap."""
    base = run.work / f"engine-{secrets.token_hex(4)}"
    org = run.origin
    region = REGION if org.kind != "url" else None  # a URL's region comes from the AWS chain
    s3 = TierConfig(
        "s3", kind="object", url=f"s3://{org.bucket}/{prefix}", endpoint_url=org.endpoint,
        region=region,
    )  # fmt: skip
    cfg = EngineConfig(
        tiers=(TierConfig("nvme", base / "nvme"), s3),
        catalog_url=f"sqlite:///{base / 'catalog.db'}",
        scan_on_start=False,
        watch=False,
    )
    base.mkdir()
    try:
        eng = Engine(cfg).start(scheduler=False)
        try:
            eng.set_policy(
                eng.policy().document() | {"bandwidth_bytes_per_s": None, "enabled": False}
            )
            yield eng
        finally:
            eng.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _on_object_tier(run: ObjRun, eng: Engine) -> int:
    """The model's file id, on the ``s3`` tier: put back and adopted again when a promotion
    removed it from a read-only origin (the same inode, so the same ETag)."""
    with contextlib.suppress(Exception):
        rec = eng.lookup("model.bin")
        if rec.tier == "s3":
            return rec.id
        eng.delete(rec.id)
    if eng.tiers.get("s3").stat("model.bin") is None:
        run.origin.put_file(run.key, run.source)
    report = eng.scan()
    if "model.bin" not in report.adopted:
        raise RuntimeError(f"the scan did not adopt {run.key}: {report.summary()}")
    return eng.lookup("model.bin").id


def _tierd_moves_and_load(run: ObjRun) -> None:
    """Promotion (and demotion, on a writable origin) round trips, then loads: one engine."""
    run.say("tierd: promotion" + (" and demotion" if run.origin.writable else "") + ", loads")
    with _engine(run, run.prefix) as eng:
        nvme = eng.tiers.get("nvme").local_root
        assert nvme is not None
        times: dict[str, list[float]] = {"promote": [], "demote": []}
        cpus: dict[str, list[float]] = {"promote": [], "demote": []}
        for i in range(1 + run.repeats):  # the first round is a warm-up
            fid = _on_object_tier(run, eng)
            for kind, tier in (("promote", "nvme"), ("demote", "s3")):
                if kind == "demote" and not run.origin.writable:
                    break
                c0, t0 = time.process_time(), time.perf_counter()
                eng.migrate(fid, tier)
                t, c = time.perf_counter() - t0, time.process_time() - c0
                if kind == "promote":
                    run.check("tierd promotion", checksum_of_file(nvme / "model.bin"))
                else:
                    run.check("tierd demotion", _s3peers.object_checksum(run, run.key))
                if i:
                    times[kind].append(t)
                    cpus[kind].append(c)
        for kind, label in (("promote", "tierd promotion"), ("demote", "tierd demotion")):
            if times[kind]:
                t, c = statistics.median(times[kind]), statistics.median(cpus[kind])
                note = "(whole move: journal, hash, fsync, verify, catalog, source removal)"
                run.rate_row(f"{kind}_tierd", f"{label} (engine.migrate)", t, c, note)
        if not run.origin.writable:
            why = f"origin {run.origin.kind} is read-only: demotion needs moto or a URL"
            run.missing("demote_tierd", "tierd demotion (engine.migrate)", why)
        _tierd_load(run, eng, _on_object_tier(run, eng))


def _tierd_load(run: ObjRun, eng: Engine, fid: int) -> None:
    label = f"tierd load -> {run.device} (Loader.load)"
    try:
        from tiering.serving import Loader, LoaderConfig

        loader = Loader(eng, LoaderConfig(cpu_budget_bytes=max(4 * GiB, 2 * run.size))).start()
    except Exception as exc:
        run.missing("load_tierd", label, f"not available: {type(exc).__name__}: {exc}")
        return
    try:

        def load() -> Any:
            return loader.load(fid, device=run.device)

        paths: set[str] = set()

        def check(lease: Any) -> None:
            if lease.report is not None:
                engine = lease.report.engine
                paths.add(f"{lease.report.io_path}" + (f" by {engine}" if engine else ""))
            arr = lease.buffer.array()
            try:
                got = checksum_of_array(arr[lease.offset : lease.offset + lease.nbytes])
                run.check("tierd load", got)
            finally:
                arr.fill(0)  # a pooled buffer handed out again must not pass on old bytes
                loader.leases.release(lease.id)

        try:
            t, cpu = run.timed(load, check)
        except AssertionError:
            raise  # BytesMismatch included: wrong bytes are never "not available"
        except Exception as exc:
            run.missing("load_tierd", label, f"not available: {type(exc).__name__}: {exc}")
            return
        note = f"(io path: {', '.join(sorted(paths))})" if paths else ""
        run.rate_row("load_tierd", label, t, cpu, note)
    finally:
        loader.stop()


def _adoption(run: ObjRun, prefix: str, objects: int) -> None:
    """``objects`` tiny objects put beforehand (untimed), then ``engine.scan()`` on a fresh
    catalog, ``repeats`` times; each scan must adopt exactly them, with their sizes."""
    run.say(f"adoption: putting {objects:,} objects")
    bodies = {f"{prefix}/o{i:06d}.bin": f"tierd-bench {i:012d}\n".encode() for i in range(objects)}
    run.origin.put_many(bodies)
    sizes = {k.partition("/")[2]: len(v) for k, v in bodies.items()}
    times = []
    for _ in range(run.repeats):
        with _engine(run, prefix) as eng:
            t0 = time.perf_counter()
            report = eng.scan()
            times.append(time.perf_counter() - t0)
            if sorted(report.adopted) != sorted(sizes):
                raise RuntimeError(
                    f"adoption: the scan adopted {len(report.adopted)} of {objects} objects"
                )
            for rel in list(sizes)[:: max(1, objects // 20)]:  # a sample: size and ETag
                rec = eng.lookup(rel)
                st = eng.tiers.get("s3").stat(rel)
                ok = st is not None and (rec.size, rec.etag) == (sizes[rel], st.etag)
                check_bytes(f"adopted {rel}", "ok" if ok else repr(rec), "ok")
    t = statistics.median(times)
    row = run.add(
        BenchRow(
            "adopt_tierd",
            f"tierd adoption: engine.scan() of {objects:,} objects",
            objects / t,
            "objects/s",
            note=f"({t:.2f} s a scan, fresh catalog each)",
        )
    )
    row.target, row.met = (
        f">= {ADOPT_TARGET:,.0f} /s",
        row.value is not None and (row.value >= ADOPT_TARGET),
    )


# -- the verdicts ---------------------------------------------------------------------------
def _best(report: Report, key: str, label: str, peers: tuple[str, ...]) -> None:
    """Row ``key``: the fastest of ``peers`` measured in this run, naming it."""
    found = [report.rows[p] for p in peers if p in report.rows and report.rows[p].value]
    if not found:
        report.add(BenchRow(key, label, None, "GB/s", note="no peer measured"))
        return
    best = max(found, key=lambda r: r.value or 0.0)
    report.add(BenchRow(key, label, best.value, "GB/s", note=f"({best.label.strip()})"))


def _compare(report: Report) -> None:
    _best(report, "promote_best", "best peer, promotion", _PROMOTE_PEERS)
    _best(report, "load_best", "best peer, load", _LOAD_PEERS)
    for key, vs, at_least in TARGETS:
        report.compare(key, vs, at_least)
    # Rows print grouped by measure (tierd first, the best peer last), not in the order the
    # run took them: tierd's figures come from one engine session before the peers'.
    groups = ("ceil_", "promote_", "demote_", "load_", "adopt_")

    def order(key: str) -> tuple[int, int]:
        group = next(i for i, g in enumerate(groups) if key.startswith(g))
        return group, 0 if key.endswith("_tierd") else 2 if key.endswith("_best") else 1

    report.rows = {k: report.rows[k] for k in sorted(report.rows, key=order)}
