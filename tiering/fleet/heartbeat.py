"""This host's row in the catalog's table of hosts: written at start, its heartbeat stamped
every few seconds on a thread of its own.

Liveness is read from the heartbeat's age alone (see :mod:`tiering.fleet.view`): no host ever
deletes or changes another's row, so there is nothing to agree on, and a host that went away
keeps its records, shown ``down``.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import socket
from collections.abc import Callable
from typing import Any

from tiering.catalog import Database
from tiering.catalog.hosts import Hosts
from tiering.config import EngineConfig
from tiering.errors import CatalogUnreachable
from tiering.periodic import Periodic
from tiering.tiers import Tiers

__all__ = ["Heartbeat", "adopt_local_records", "default_address", "host_database", "tier_report"]

log = logging.getLogger(__name__)

#: A host's GPUs as it publishes them: ``[{"device": "cuda:0", "leased_bytes": n}, ...]``.
GpuReport = Callable[[], list[dict[str, Any]]]


def default_address(port: int) -> str:
    """``http://<hostname>:<port>``: where other hosts and schedulers reach this one's API."""
    return f"http://{socket.gethostname()}:{port}"


def tier_report(tiers: Tiers) -> list[dict[str, Any]]:
    """This host's storage tiers as the fleet sees them. A shared tier's (a bucket's) files are
    every host's; another tier is this host's own."""
    return [
        {"name": t.name, "kind": t.kind, "rank": rank, "shared": t.capabilities.shared}
        for rank, t in enumerate(tiers)
    ]


def _version() -> str:
    # The installed distribution's (the root package is above every room of the layout).
    try:
        return importlib.metadata.version("tierd")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def host_database(config: EngineConfig, tiers: Tiers) -> Database:
    """The catalog as this host writes it: each file it places on one of its own tiers is
    recorded as this host's, and files on shared tiers (object stores) as no host's."""
    return Database(
        config.catalog_url,
        busy_timeout_ms=config.busy_timeout_ms,
        host=config.host_id,
        shared_tiers=[t.name for t in tiers if t.capabilities.shared],
    )


def peers_off(db: Database, tiers: Tiers, fleet_token: str | None) -> str | None:
    """Why this host reads a fleet's shared files without its peers, or None: hosts share the
    catalog (PostgreSQL) and a bucket tier, but no ``fleet_token`` is set, so no host serves
    or asks its peers and each one reads every file from the bucket itself. Said at start, in
    ``/readyz`` and ``/metrics``, since nothing else would show it but the bucket's bill."""
    shared = [t.name for t in tiers if t.capabilities.shared]
    if db.single_writer or not shared or fleet_token:
        return None
    return (
        f"peers are off: this host shares its catalog and tier(s) {', '.join(shared)} with "
        "other hosts but has no fleet_token, so every host reads the bucket itself; set the "
        "same TIERD_FLEET_TOKEN on every host to exchange pieces between hosts"
    )


def adopt_local_records(db: Database, tiers: Tiers, host_id: str) -> None:
    """On SQLite, where one tierd ever writes the catalog (its lock), every record on a local
    tier is this host's: those from before hosts were recorded, and those written under an
    earlier host id (a recreated container's new hostname), which scan and the planner would
    otherwise leave alone for good. Run before recovery and the scan."""
    if db.single_writer:
        Hosts(db).adopt_files(host_id, [t.name for t in tiers if not t.capabilities.shared])


class Heartbeat:
    """Registers ``host_id`` at :meth:`start`, then stamps its heartbeat every
    ``interval_s`` until :meth:`stop`.

    ``gpus`` is asked at every beat; the serving layer sets it to report leased bytes per
    device (the engine knows no leases).
    """

    def __init__(
        self,
        hosts: Hosts,
        *,
        host_id: str,
        address: str,
        version: str,
        tiers: Tiers,
        interval_s: float,
    ) -> None:
        self.hosts = hosts
        self.host_id = host_id
        self.address = address
        self.version = version
        self.tiers = tiers
        self.gpus: GpuReport = list
        self._thread = Periodic(self._beat, interval_s, name=f"tierd-heartbeat-{host_id}"[:60])
        self._missed = 0  # beats in a row the catalog could not take

    @classmethod
    def start_for(cls, db: Database, tiers: Tiers, config: EngineConfig) -> Heartbeat | None:
        """The engine's heartbeat, registered and started, or None where it has no
        ``advertise_url`` (a library use).

        """
        if not config.advertise_url:
            return None
        hosts = Hosts(db)
        beat = cls(
            hosts,
            host_id=config.host_id,
            address=config.advertise_url,
            version=_version(),
            tiers=tiers,
            interval_s=config.heartbeat_interval_s,
        )
        beat.start()
        return beat

    def report(self) -> str:
        return json.dumps({"tiers": tier_report(self.tiers), "gpus": self.gpus()})

    def start(self) -> None:
        self.hosts.register(
            self.host_id, address=self.address, version=self.version, report=self.report()
        )
        self._thread.start()

    def beat(self) -> None:
        if not self.hosts.heartbeat(self.host_id, report=self.report()):
            # Someone deleted the row (by hand): register again rather than vanish.
            log.warning("host %r had no row in the catalog; registering again", self.host_id)
            self.hosts.register(
                self.host_id, address=self.address, version=self.version, report=self.report()
            )

    def _beat(self) -> None:
        """A beat on the thread: one that finds the catalog unreachable is counted, not
        logged each time (the database logs the outage); the next one that lands resumes."""
        try:
            self.beat()
        except CatalogUnreachable:
            self._missed += 1
            return
        if self._missed:
            log.info("heartbeat of %r resumes after %d missed beats", self.host_id, self._missed)
        self._missed = 0

    def stop(self) -> None:
        self._thread.stop()
