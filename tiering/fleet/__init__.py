"""Hosts sharing one catalog: this host's registration and heartbeat, and the fleet's view of
every host (their tiers, GPUs and liveness) and of where each file is."""

from tiering.fleet.heartbeat import (
    Heartbeat,
    adopt_local_records,
    default_address,
    host_database,
    peers_off,
)
from tiering.fleet.uploads import MAX_UPLOADS, PeerBody, PeerUploads
from tiering.fleet.view import (
    FleetHost,
    FleetTier,
    HostPieces,
    HostPlace,
    Located,
    fleet_hosts,
    locate,
)

__all__ = [
    "MAX_UPLOADS",
    "PeerBody",
    "PeerUploads",
    "FleetHost",
    "FleetTier",
    "Heartbeat",
    "HostPieces",
    "HostPlace",
    "Located",
    "adopt_local_records",
    "default_address",
    "host_database",
    "fleet_hosts",
    "locate",
    "peers_off",
]
