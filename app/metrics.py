"""Prometheus metrics: ``GET /metrics``, the load observer and the HTTP middleware.

Base units (bytes, seconds), ``_total`` counters, and no per-file labels: label values come
from small fixed sets (op, I/O path, tier, device, route template, status). Each app has its
own registry, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator, Mapping

from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tiering.catalog import MigrationPhase
from tiering.engine import Engine
from tiering.io import Device, IoReport
from tiering.serving import Loader

__all__ = ["HttpMetrics", "Metrics", "router"]

log = logging.getLogger(__name__)

# Latency buckets: 100 µs (a 4 KiB read from the page cache) to 30 s (a large cold load).
_SUB_SECOND = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
_LATENCY_BUCKETS = (*_SUB_SECOND, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The registry of one app and the metrics tierd updates as it works."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # The process's own (process_cpu_seconds_total, resident memory, open fds, start time)
        # and the interpreter's (python_info), as every Prometheus client exports by default.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.loaded_bytes = Counter(
            "tierd_loaded_bytes",
            "Bytes loaded into buffers (leases), by operation, device, I/O path and tier",
            ["op", "device", "io_path", "tier"],
            registry=r,
        )
        self.loads = Counter(
            "tierd_loads",
            "Completed loads (one per lease or shard), by operation, I/O path and tier",
            ["op", "io_path", "tier"],
            registry=r,
        )
        # Where loaded bytes came from: families of their own, so the series above (and the
        # rules and dashboards built on them) stay as they were.
        self.source_bytes = Counter(
            "tierd_loaded_bytes_by_source",
            "Bytes loaded into buffers, by tier and by where they came from (source: gpu, peer, "
            "memory, page_cache, storage, object_store); 0 for a lease handed out from a "
            "resident copy",
            ["tier", "source"],
            registry=r,
        )
        self.source_loads = Counter(
            "tierd_loads_by_source",
            "Completed loads (one per lease or shard), by tier and source",
            ["tier", "source"],
            registry=r,
        )
        # With tierd_loaded_bytes' device label: rate(bytes) / rate(seconds) is a GPU's GB/s.
        self.device_seconds = Counter(
            "tierd_load_seconds_by_device",
            "Seconds spent reading loads into each device (replicas' copies included)",
            ["device"],
            registry=r,
        )
        self.load_seconds = Histogram(
            "tierd_load_duration_seconds",
            "Time reading one load's bytes into its buffer",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.peer_bytes_served = Counter(
            "tierd_peer_bytes_served",
            "Bytes this host served to other hosts of its fleet (GET /v1/peer/content), by "
            "where they came from here (source: memory, copy, tier)",
            ["source"],
            registry=r,
        )
        self.http_requests = Counter(
            "tierd_http_requests",
            "HTTP requests answered, by method, route template and status",
            ["method", "route", "status"],
            registry=r,
        )
        self.http_seconds = Histogram(
            "tierd_http_request_duration_seconds",
            "Time to answer an HTTP request, by method and route template",
            ["method", "route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def observe_load(self, op: str, device: Device, report: IoReport) -> None:
        """The :class:`~tiering.serving.loader.Loader`'s observer."""
        self.loaded_bytes.labels(op, str(device), report.io_path, report.tier).inc(report.nbytes)
        self.loads.labels(op, report.io_path, report.tier).inc()
        self.source_bytes.labels(report.tier, report.source).inc(report.nbytes)
        self.source_loads.labels(report.tier, report.source).inc()
        self.load_seconds.labels(op).observe(report.seconds)
        self.device_seconds.labels(str(device)).inc(report.seconds)

    def watch(self, engine: Engine, loader: Loader) -> None:
        """Add the gauges read at scrape time from the engine and the loader."""
        self.registry.register(_StateCollector(engine, loader))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _per_device(name: str, doc: str, values: Mapping[str, int]) -> GaugeMetricFamily:
    """One gauge family with a ``device`` label, its series sorted by device."""
    family = GaugeMetricFamily(name, doc, labels=["device"])
    for dev, n in sorted(values.items()):
        family.add_metric([dev], n)
    return family


class _StateCollector(Collector):
    def __init__(self, engine: Engine, loader: Loader) -> None:
        self.engine = engine
        self.loader = loader

    def describe(self) -> list[Metric]:
        return []  # collected lazily: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        yield from self._leases()
        yield from self._residency()
        yield from self._jobs()
        yield from self._memory()
        yield from self._fleet()
        yield from self._catalog()
        yield from self._tier_limits()
        yield GaugeMetricFamily(
            "tierd_fleet_peers_off",
            "1 where hosts share the catalog and a bucket but no fleet_token is set: every "
            "host reads the bucket itself (GET /readyz says why)",
            value=0 if self.engine.peers_off is None else 1,
        )
        damage = self.engine.damage
        yield CounterMetricFamily(
            "tierd_integrity_failures",
            "Stored bytes found damaged (a chunk failing its digest, a broken container) by a "
            "read or a scan; each file is quarantined (GET /readyz lists them)",
            value=damage.failures,
        )
        yield GaugeMetricFamily(
            "tierd_damaged_files",
            "Files this process found damaged that are still quarantined",
            value=len(damage.items()),
        )
        watcher = self.engine.watcher
        if watcher is not None:
            yield GaugeMetricFamily(
                "tierd_watcher_healthy",
                "1 while the live watcher of the tier roots is healthy, 0 when degraded",
                value=1 if watcher.status().healthy else 0,
            )

    def _leases(self) -> Iterator[Metric]:
        leases = self.loader.leases
        yield _per_device(
            "tierd_leased_bytes",
            "Allocated bytes leased to clients, per device",
            leases.leased_bytes(),
        )
        yield _per_device("tierd_lease_budget_bytes", "Lease budget per device", leases.budgets())
        yield _per_device(
            "tierd_buffer_cache_bytes",
            "Released GPU buffers kept for reuse (within the budget), per device",
            leases.pool.idle_bytes(),
        )
        yield _per_device(
            "tierd_leases",
            "Live buffer leases",
            collections.Counter(str(lease.device) for lease in leases.all()),
        )
        yield CounterMetricFamily(
            "tierd_leases_expired", "Leases freed by the reaper", value=leases.expired_total
        )

    def _residency(self) -> Iterator[Metric]:
        residency = self.loader.residency
        yield _per_device(
            "tierd_resident_bytes",
            "Allocated bytes of read-only resident copies (shared loads, gpu prefetches) that "
            "loads are handed or copy from, per device; those leases hold count in "
            "tierd_leased_bytes too, those kept count in tierd_resident_kept_bytes",
            residency.resident_bytes(),
        )
        yield _per_device(
            "tierd_resident_kept_bytes",
            "Allocated bytes of resident copies no lease holds, kept for the next load, per "
            "device (let go when a lease needs the room)",
            residency.kept_bytes(),
        )

    def _jobs(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily(
            "tierd_jobs", "Prefetch jobs kept, by target and state", labels=["target", "state"]
        )
        by_state = collections.Counter((job.target, job.state) for job in self.loader.jobs.all())
        for (target, state), n in sorted(by_state.items()):
            jobs.add_metric([target, state], n)
        yield jobs

    def _catalog(self) -> Iterator[Metric]:
        try:
            usage = self.engine.catalog.usage()
            phases = self.engine.journal.phase_counts()
        except Exception as exc:  # a busy or stopped catalog must not fail the scrape
            log.warning("catalog metrics skipped: %s", exc)
            return
        files = GaugeMetricFamily("tierd_catalog_files", "Files in the catalog", labels=["tier"])
        nbytes = GaugeMetricFamily(
            "tierd_catalog_bytes", "Bytes of the catalog's files (logical)", labels=["tier"]
        )
        stored = GaugeMetricFamily(
            "tierd_catalog_stored_bytes",
            "Bytes the catalog's files take on their tier (compressed files' stored bytes)",
            labels=["tier"],
        )
        saved = GaugeMetricFamily(
            "tierd_compression_saved_bytes",
            "Bytes compression saves on the tier: logical minus stored bytes of its files",
            labels=["tier"],
        )
        for tier in self.engine.tiers:
            u = usage.get(tier.name)
            files.add_metric([tier.name], u.files if u else 0)
            nbytes.add_metric([tier.name], u.bytes if u else 0)
            stored.add_metric([tier.name], u.stored if u else 0)
            saved.add_metric([tier.name], u.bytes - u.stored if u else 0)
        yield from (files, nbytes, stored, saved)
        finished = CounterMetricFamily(
            "tierd_migrations", "Finished migrations, by outcome", labels=["state"]
        )
        in_flight = 0
        for phase, n in sorted(phases.items()):
            if phase in MigrationPhase.OPEN:
                in_flight += n
            else:
                finished.add_metric([phase], n)
        yield finished
        yield GaugeMetricFamily(
            "tierd_migrations_in_flight", "Migrations copying or switching now", value=in_flight
        )

    def _memory(self) -> Iterator[Metric]:
        # The memory tier's copies (a cache: its files stay in tierd_catalog_* on their tiers).
        memory = self.engine.memory
        if memory is None:
            return
        entries = memory.entries()
        labels = [memory.name]
        held = GaugeMetricFamily(
            "tierd_memory_tier_bytes",
            "Bytes of the copies the memory tier holds in pinned host memory",
            labels=["tier"],
        )
        held.add_metric(labels, sum(e.size for e in entries))
        yield held
        count = GaugeMetricFamily(
            "tierd_memory_tier_files", "Copies the memory tier holds", labels=["tier"]
        )
        count.add_metric(labels, len(entries))
        yield count
        fills = CounterMetricFamily(
            "tierd_memory_tier_fills", "Copies made into the memory tier", labels=["tier"]
        )
        fills.add_metric(labels, memory.tier.fills)
        yield fills
        drops = CounterMetricFamily(
            "tierd_memory_tier_drops",
            "Copies the memory tier dropped, by reason (cold, watermark, evicted, pressure, "
            "stale, deleted...)",
            labels=["tier", "reason"],
        )
        for reason, n in sorted(memory.tier.drops.items()):
            drops.add_metric([memory.name, reason], n)
        yield drops

    def _fleet(self) -> Iterator[Metric]:
        # Bytes between this host and the fleet: what came from peers (tierd_peer_bytes_served
        # counts what went to them), and what the shared tiers' origin (the bucket) sent this
        # host, whatever read it: the number a fleet distribution is there to keep down.
        origin = CounterMetricFamily(
            "tierd_origin_bytes_read",
            "Bytes this host read from a shared tier's origin (the bucket), by tier: loads, "
            "promotions and copies alike",
            labels=["tier"],
        )
        for tier in self.engine.tiers:
            if tier.capabilities.shared:
                origin.add_metric([tier.name], tier.origin_bytes_read())
        yield origin
        peers = self.loader.peers
        if peers is None:
            return
        received = CounterMetricFamily(
            "tierd_peer_bytes_received",
            "Bytes this host received from other hosts of its fleet (GET /v1/peer/content), "
            "checked against the piece digests where the catalog has them, by use (load)",
            labels=["use"],
        )
        received.add_metric(["load"], peers.bytes_received)
        yield received
        yield CounterMetricFamily(
            "tierd_peer_bad_pieces",
            "Pieces from peers that failed their digest (dropped, the peer avoided a while)",
            value=peers.bad_pieces,
        )

    def _tier_limits(self) -> Iterator[Metric]:
        # The policy's quota and high watermark per tier, so alerts can compare them with
        # tierd_catalog_bytes; a tier without a quota has no series (nothing to exceed).
        quota = GaugeMetricFamily(
            "tierd_tier_quota_bytes", "Most bytes tierd places on a tier", labels=["tier"]
        )
        high = GaugeMetricFamily(
            "tierd_tier_high_watermark_ratio",
            "Fraction of a tier's quota past which tierd demotes files",
            labels=["tier"],
        )
        policy = self.engine.policy()
        for tier in self.engine.tiers:
            q = self.engine.quota(tier.name)
            if q is None:
                continue
            quota.add_metric([tier.name], q)
            rules = policy.tiers.get(tier.name)
            high.add_metric([tier.name], rules.high_watermark if rules is not None else 0.9)
        memory = self.engine.memory
        if memory is not None:
            quota.add_metric([memory.name], memory.quota_bytes)
            rules = policy.tiers.get(memory.name)
            high.add_metric([memory.name], rules.high_watermark if rules is not None else 0.9)
        yield quota
        yield high


class HttpMetrics:
    """ASGI middleware counting requests by route *template*, never by raw path."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "<unmatched>"
            method = scope.get("method", "")
            self.metrics.http_requests.labels(method, template, str(status)).inc()
            self.metrics.http_seconds.labels(method, template).observe(
                time.perf_counter() - started
            )


router = APIRouter(tags=["health"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
def metrics(request: Request) -> Response:
    """Prometheus text format (no auth, like the health probes)."""
    m: Metrics = request.app.state.metrics
    return Response(m.render(), media_type=CONTENT_TYPE_LATEST)
