"""Loads (object → host or GPU memory) of the object-store bench, for each device of the run.

- tierd: :class:`~tiering.serving.Loader` ``load`` of the object adopted on the ``s3`` tier,
  in this process, into each device (``load_tierd_<dev>``); then its 4 KiB reads
  (:func:`._objlatency.tierd_small`), on the same loader;
- the peers, into the same device: ranged GETs by hand with boto3, obstore's async ranged GETs
  and s3fs into host memory (pinned on a GPU) then one copy, and KvikIO's ``RemoteFile``
  (``load_<peer>_<dev>``), each with the run's connections and :data:`._objrun.PART`.

A device is ``cuda`` or ``cpu`` in row keys: a run on ``cuda:N`` measures both, so one table
holds the GPU figures and the host-memory ones that the 2-core box can be held against.
"""

from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from tiering.engine import Engine
from tiering.io import GdsConfig

from . import _objlatency
from ._measure import GiB, MiB, free_gpu, frees_gpu
from ._objrun import PART, BytesMismatch, ObjRun, checksum_of_array
from ._s3peers import Target, get_into, obstore_ranges, obstore_store, parts, s3fs_of

__all__ = ["PEERS", "load_peers", "tierd_loads"]

#: The load peers' row keys, before the ``_<dev>`` suffix (Run:ai's are :mod:`._runai`'s).
PEERS = ("load_boto3_ranges", "load_obstore_ranges", "load_s3fs", "load_kvikio")


# -- tierd, in this process ------------------------------------------------------------------
def tierd_loads(run: ObjRun, eng: Engine, fid: int, devices: list[str]) -> None:
    """``load_tierd_<dev>`` for each of ``devices``, then tierd's 4 KiB reads, one loader."""
    try:
        from tiering.serving import Loader, LoaderConfig

        budget = max(4 * GiB, 2 * run.size)
        loader = Loader(eng, LoaderConfig(cpu_budget_bytes=budget)).start()
    except Exception as exc:
        for device in devices:
            on = run.on(device)
            why = f"not available: {type(exc).__name__}: {exc}"
            on.missing(f"load_tierd_{on.dev}", _label(on), why)
        return
    try:
        for device in devices:
            _tierd_load(run.on(device), loader, fid)
            free_gpu()
            _alternated(run.on(device), loader, fid)
            free_gpu()
        _objlatency.tierd_small(run.on("cpu"), loader, fid)
    finally:
        loader.stop()


def _label(run: ObjRun) -> str:
    return f"tierd load -> {run.device} (Loader.load, in process)"


def _tierd_load(run: ObjRun, loader: Any, fid: int) -> None:
    key, label = f"load_tierd_{run.dev}", _label(run)

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
        run.missing(key, label, f"not available: {type(exc).__name__}: {exc}")
        return
    note = f"(io path: {', '.join(sorted(paths))})" if paths else ""
    run.rate_row(key, label, t, cpu, note)


def _alternated(run: ObjRun, loader: Any, fid: int) -> None:
    """tierd's load and KvikIO's ``RemoteFile`` (at tierd's thread count and task size) taken
    in turns, one of each per round: rows ``load_tierd_alt_<dev>`` and
    ``load_kvikio_alt_<dev>``, with the process's CPU seconds a load.

    On an origin that shares the host's cores, a load's time has two modes (about 56 and about
    100 ms for 1 GiB on the H100 machine, for both readers), and which block of loads gets more
    slow ones moved the ratio of the separate rows by ±10 %; in turns, both see the same
    minutes of the origin.
    """
    keys = {"tierd": f"load_tierd_alt_{run.dev}", "kvikio": f"load_kvikio_alt_{run.dev}"}
    threads = GdsConfig().remote_url_threads
    labels = {
        "tierd": "  tierd load, in turns with KvikIO RemoteFile",
        "kvikio": f"  KvikIO RemoteFile ({threads} threads x {PART // MiB} MiB), in turns",
    }
    try:
        kvikio = importlib.import_module("kvikio")
        defaults = importlib.import_module("kvikio.defaults")
    except ImportError:
        for who, key in keys.items():
            run.missing(key, labels[who], "kvikio not installed")
        return
    url = run.origin.url_of(run.key)
    opener = kvikio.RemoteFile.open_http if run.origin.nginx else kvikio.RemoteFile.open_s3_url
    if run.cuda:
        buf: Any = importlib.import_module("cupy").empty(run.size, np.uint8)
    else:
        buf = np.empty(run.size, np.uint8)

    def tierd(by: Any) -> Callable[[], Callable[[], None]]:
        def load() -> Callable[[], None]:
            lease = by.load(fid, device=run.device)

            def check() -> None:  # off the clock, then the lease goes back to the pool
                try:
                    arr = lease.buffer.array()
                    got = checksum_of_array(arr[lease.offset : lease.offset + lease.nbytes])
                    run.check("tierd load", got)
                finally:
                    arr.fill(0)  # a pooled buffer handed out again must not pass on old bytes
                    by.leases.release(lease.id)

            return check

        return load

    def kv() -> Callable[[], None]:
        with opener(url) as f:
            f.read(buf)
        return lambda: run.check("KvikIO RemoteFile", checksum_of_array(buf))

    loads = {"tierd": tierd(loader), "kvikio": kv}
    times: dict[str, list[float]] = {who: [] for who in loads}
    cpus: dict[str, list[float]] = {who: [] for who in loads}
    with defaults.set({"num_threads": threads, "task_size": PART}):
        for i in range(1 + run.repeats):  # the first round warms both up
            for who, fn in loads.items():
                if who == "kvikio":
                    buf.fill(0)  # a read that wrote nothing cannot pass the check
                run.sync()
                c0, t0 = time.process_time(), time.perf_counter()
                check = fn()
                run.sync()
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                check()
                if i:
                    times[who].append(dt)
                    cpus[who].append(cpu)
    for who, key in keys.items():
        run.rate_row(key, labels[who], statistics.median(times[who]), statistics.median(cpus[who]))


# -- the peers ---------------------------------------------------------------------------------
@frees_gpu
def load_peers(run: ObjRun) -> None:
    """Every load peer into ``run.device``: rows ``load_<peer>_<dev>``."""
    dev = run.dev
    run.say(f"load peers: object -> {'GPU' if run.cuda else 'host memory'}")
    target = Target(run)
    then = " + copy to GPU" if run.cuda else ""
    client = run.origin.client(pool=run.conns)

    def check(what: str) -> Callable[[Any], None]:
        return lambda buf: run.check(what, checksum_of_array(buf))

    with ThreadPoolExecutor(run.conns, thread_name_prefix="tierd-bench-get") as pool:

        def by_hand() -> Any:
            futures = [
                pool.submit(get_into, client, run, target.view[o : o + n], o)
                for o, n in parts(run.size)
            ]
            for f in futures:
                f.result()
            return target.done()

        t, cpu = run.timed(by_hand, check("boto3 ranged GETs"), before=target.clear)
    run.rate_row(
        f"load_boto3_ranges_{dev}",
        f"boto3 ranged GETs by hand ({run.conns} x {PART // MiB} MiB){then}",
        t,
        cpu,
    )
    _obstore_load(run, target, then, check)
    _s3fs_load(run, target, then, check)
    _kvikio_load(run, target, check)


Check = Callable[[str], Callable[[Any], None]]


def _obstore_load(run: ObjRun, target: Target, then: str, check: Check) -> None:
    key = f"load_obstore_ranges_{run.dev}"
    label = f"obstore async ranged GETs ({run.conns} x {PART // MiB} MiB){then}"
    try:
        obs = importlib.import_module("obstore")
    except ImportError:
        run.missing(key, label, "not installed (pip install obstore)")
        return
    store = obstore_store(run)

    def sink(off: int, data: Any) -> None:
        target.host[off : off + len(data)] = np.frombuffer(data, np.uint8)

    def ob() -> Any:
        obstore_ranges(obs, store, run, sink)
        return target.done()

    t, cpu = run.timed(ob, check("obstore ranged GETs"), before=target.clear)
    run.rate_row(key, label, t, cpu)


def _s3fs_load(run: ObjRun, target: Target, then: str, check: Check) -> None:
    key = f"load_s3fs_{run.dev}"
    try:
        fs = s3fs_of(run)
    except ImportError:
        run.missing(key, "s3fs cat_file", "not installed (pip install s3fs)")
        return

    def cat() -> Any:
        data = fs.cat_file(f"{run.origin.bucket}/{run.key}")
        target.host[:] = np.frombuffer(data, np.uint8)
        return target.done()

    t, cpu = run.timed(cat, check("s3fs cat_file"), before=target.clear)
    run.rate_row(key, f"s3fs cat_file{then}", t, cpu)


def _kvikio_load(run: ObjRun, target: Target, check: Check) -> None:
    key = f"load_kvikio_{run.dev}"
    label = f"KvikIO RemoteFile ({run.conns} threads x {PART // MiB} MiB) -> {run.dev}"
    try:
        kvikio = importlib.import_module("kvikio")
        kvikio_defaults = importlib.import_module("kvikio.defaults")
    except ImportError:
        run.missing(key, label, "kvikio not installed")
        return
    url = run.origin.url_of(run.key)
    remote = kvikio.RemoteFile
    opener = remote.open_http if run.origin.nginx else remote.open_s3_url
    buf = target.dev if target.dev is not None else target.host

    def read() -> Any:
        with opener(url) as f:
            f.read(buf)
        return buf

    # At the run's connections (the "tuned by hand": 64), and, where tierd's own
    # default differs, at tierd's count too: a ratio that comes from more connections alone is
    # then visible as such.
    ours = GdsConfig().remote_url_threads
    counts = [(key, label, run.conns)]
    if ours != run.conns:
        counts.append(
            (
                f"{key}_at_tierd_threads",
                f"KvikIO RemoteFile ({ours} threads x {PART // MiB} MiB, tierd's count) "
                f"-> {run.dev}",
                ours,
            )
        )
    for row, text, threads in counts:
        try:
            with kvikio_defaults.set({"num_threads": threads, "task_size": PART}):
                t, cpu = run.timed(read, check("KvikIO RemoteFile"), before=target.clear)
        except BytesMismatch:
            raise
        except Exception as exc:  # an older KvikIO, or one built without remote IO
            run.missing(row, text, f"failed: {type(exc).__name__}: {exc}")
            continue
        run.rate_row(row, text, t, cpu)
