"""Which heat promotes a file off a shared tier: this host's, or the fleet's.

Hosts that share a catalog share its object-store tiers, so a file there has two heats:

- the **fleet's**, ``files.heat``: every host's access flush adds to the file's one record;
- **this host's own**, its ``host_heat`` row (see :mod:`tiering.catalog.heat`); a host with no
  row for the file has heat 0 there.

Policy ``promotion_heat`` picks which one lifts a shared file onto this host's own tiers (by a
move, or by a copy where the object store is the fleet's origin):

- ``local`` (the default): each host warms what *it* reads. A model served by host A only is
  not pulled onto B's NVMe because A is busy; each host's fast tiers hold its own working set,
  and a host added to the fleet starts cold rather than copying what the others read.
- ``fleet``: every host warms what *any* host reads. Use it where hosts are interchangeable
  and a scheduler may send any request to any of them: a model hot anywhere is then warm on
  every host before its first request there, at the price of fast-tier room (and object-store
  reads) on hosts that may never read it.

Every other decision (demotions, files on a host's own tiers, which only that host reads) uses
the file's one heat, which for them is also the host's. On a catalog only one host writes
(SQLite) the two are the same by definition: :func:`local_heat` returns None there and the
fleet's heat is used, so a single host plans exactly as before hosts kept their own heat.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tiering.catalog import Catalog, decay
from tiering.catalog.db import Database
from tiering.catalog.heat import HostHeats
from tiering.placement.policy import FileView, Policy, heat_now

__all__ = ["LocalHeat", "has_local_heat", "heat_for_promotion", "local_heat"]


@dataclass(frozen=True)
class LocalHeat:
    """This host's own heat of the files on shared tiers, as read from the catalog once per
    planning pass: file id -> ``(heat, heat_at)``, undecayed (the planner decays it with the
    half-life of the policy it plans with)."""

    shared_tiers: frozenset[str]
    rows: Mapping[int, tuple[float, float]] = field(default_factory=dict)


def has_local_heat(db: Database) -> bool:
    """Whether this host's heat of a shared file can differ from the fleet's: False on a
    catalog only this host writes (SQLite), with no host id, or with no shared tier."""
    return not db.single_writer and db.host is not None and bool(db.shared_tiers)


def local_heat(catalog: Catalog) -> LocalHeat | None:
    """This host's rows, for :func:`heat_for_promotion` (one query); None where
    :func:`has_local_heat` says the fleet's heat is this host's."""
    db = catalog.db
    if not has_local_heat(db) or db.host is None:
        return None
    return LocalHeat(db.shared_tiers, HostHeats(db).raw(db.host))


def heat_for_promotion(policy: Policy, rec: FileView, now: float, local: LocalHeat | None) -> float:
    """The heat that decides whether ``rec`` is lifted off a shared tier onto this host's
    tiers, decayed to ``now``: this host's own, or the fleet's, per ``policy.promotion_heat``.

    For a file on a host's own tier, or with ``local`` None (see :func:`local_heat`), it is the
    file's heat in the catalog. The storage planner (:func:`tiering.placement.explain.decide`)
    and the planner of host copies call this; nothing else should decide between the two.
    """
    if local is None or policy.promotion_heat == "fleet" or rec.tier not in local.shared_tiers:
        return heat_now(rec, policy, now)
    row = local.rows.get(rec.id)
    return 0.0 if row is None else decay(row[0], row[1], now, policy.half_life_s)
