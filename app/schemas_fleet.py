"""Response models of the fleet routes (``/v1/fleet``): the hosts sharing this catalog, and
where files and models are among them.

A host's tiers and GPUs come from the report it wrote in its own heartbeat, perhaps by another
tierd version: they are read leniently (a field of the wrong type is dropped, not a 500).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from tiering.fleet import FleetHost, HostPlace, Located

__all__ = [
    "FleetHostOut",
    "FleetHostsOut",
    "FleetTierOut",
    "GpuOut",
    "HostHoldingOut",
    "LocateOut",
    "LocatedFileOut",
    "PlaceOut",
]

State = Literal["up", "down"]


class FleetTierOut(BaseModel):
    name: str
    kind: str = Field(description="directory or object")
    rank: int = Field(description="0 is the host's fastest tier")
    shared: bool = Field(description="An object store every host that has it shares")
    files: int = Field(description="Files the catalog records there (the fleet's, if shared)")
    bytes: int


class GpuOut(BaseModel):
    device: str = Field(description="cuda:N")
    leased_bytes: int = Field(description="Bytes leased to clients on the device now")
    budget_bytes: int | None = Field(default=None, description="The most that may be leased")


class FleetHostOut(BaseModel):
    host_id: str
    address: str = Field(description="Where the host's API is reached")
    state: State = Field(description="down once its heartbeat is older than the timeout")
    started_at: float
    last_heartbeat: float
    heartbeat_age_s: float
    version: str
    tiers: list[FleetTierOut]
    gpus: list[GpuOut]
    cpu_leased_bytes: int = Field(description="Bytes leased to clients in host shared memory")

    @classmethod
    def of(cls, h: FleetHost, now: float) -> FleetHostOut:
        gpus: list[GpuOut] = []
        cpu = 0
        for d in h.gpus:
            dev, n = d.get("device"), _int_or_none(d.get("leased_bytes"))
            if not isinstance(dev, str) or n is None:
                continue
            budget = d.get("budget_bytes")
            if dev == "cpu":
                cpu = n
            elif dev.startswith("cuda"):
                gpus.append(GpuOut(device=dev, leased_bytes=n, budget_bytes=_int_or_none(budget)))
        return cls(
            host_id=h.host_id,
            address=h.address,
            state="up" if h.state == "up" else "down",
            started_at=h.started_at,
            last_heartbeat=h.last_heartbeat,
            heartbeat_age_s=max(0.0, now - h.last_heartbeat),
            version=h.version,
            tiers=[FleetTierOut(**vars(t)) for t in h.tiers],
            gpus=gpus,
            cpu_leased_bytes=cpu,
        )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_or_none(v: Any) -> int | None:
    return v if _is_int(v) else None


class FleetHostsOut(BaseModel):
    items: list[FleetHostOut] = Field(description="Every host registered, by id")
    host_timeout_s: float = Field(description="Heartbeat age past which a host is shown down")
    this_host: str = Field(description="The id of the host that answered")


class PlaceOut(BaseModel):
    host_id: str
    address: str
    state: State
    kind: Literal["memory", "tier", "object_store"] = Field(
        description="memory: a cached copy in the host's memory tier; tier: on one of its own "
        "tiers; object_store: in a shared bucket the host reads"
    )
    location: str = Field(description="The tier (or memory tier) name")
    rank: int | None = Field(description="The tier's rank on that host (None for memory)")

    @classmethod
    def of(cls, p: HostPlace) -> PlaceOut:
        return cls(
            host_id=p.host_id,
            address=p.address,
            state="up" if p.state == "up" else "down",
            kind=p.kind,  # type: ignore[arg-type]
            location=p.location,
            rank=p.rank,
        )


class LocatedFileOut(BaseModel):
    id: int
    path: str
    size: int
    state: str
    tier: str = Field(description="The tier of its authoritative bytes")
    host: str | None = Field(description="The host whose tier that is (None: a shared tier)")
    places: list[PlaceOut] = Field(description="Every place a host has it, warmest first")

    @classmethod
    def of(cls, loc: Located) -> LocatedFileOut:
        r = loc.record
        return cls(
            id=r.id,
            path=r.relpath,
            size=r.size,
            state=r.state,
            tier=r.tier,
            host=r.host,
            places=[PlaceOut.of(p) for p in loc.places],
        )


class HostHoldingOut(BaseModel):
    """How much of what was asked for one host holds, in any place."""

    host_id: str
    state: State
    files: int
    bytes: int
    complete: bool = Field(description="The host holds every file asked for")
    warmth: Literal["memory", "tier", "object_store"] = Field(
        description="How warm the host holds all of them: the kind of its warmest place of "
        "its coldest file"
    )


class LocateOut(BaseModel):
    path: str | None = None
    model: str | None = None
    files: list[LocatedFileOut]
    hosts: list[HostHoldingOut] = Field(
        description="Hosts that hold any of the files: complete ones first, then by warmth"
    )

    @classmethod
    def of(cls, located: list[Located], **asked: str | None) -> LocateOut:
        order = {"memory": 0, "tier": 1, "object_store": 2}
        per: dict[str, dict[str, Any]] = {}
        for loc in located:
            best: dict[str, HostPlace] = {}
            for p in loc.places:  # warmest first: the first place of a host is its best
                best.setdefault(p.host_id, p)
            for hid, p in best.items():
                h = per.setdefault(hid, {"state": p.state, "files": 0, "bytes": 0, "worst": 0})
                h["files"] += 1
                h["bytes"] += loc.record.size
                h["worst"] = max(h["worst"], order[p.kind])
        kinds = {v: k for k, v in order.items()}
        hosts = [
            HostHoldingOut(
                host_id=hid,
                state="up" if h["state"] == "up" else "down",
                files=h["files"],
                bytes=h["bytes"],
                complete=h["files"] == len(located),
                warmth=kinds[h["worst"]],  # type: ignore[arg-type]
            )
            for hid, h in per.items()
        ]
        hosts.sort(key=lambda h: (not h.complete, h.state != "up", order[h.warmth], h.host_id))
        return cls(files=[LocatedFileOut.of(x) for x in located], hosts=hosts, **asked)
