"""The tiering policy and the planner.

The policy is a validated, versioned document: which heat sends a file to which tier, with a
hysteresis band so that a file sitting at a threshold does not ping-pong, per-tier quotas with
high and low watermarks, a minimum age before a move, and the scheduler's knobs (interval,
concurrency, bandwidth cap).

:func:`plan` is a pure function of (files, policy, tier usage, now): it reads nothing else and
changes nothing, so it can be tested exhaustively. Its guarantees:

- it never plans a move that takes a tier past its capacity (free space, and the high watermark
  of its quota), and a tier already past its capacity only shrinks;
- it plans at most one move per file;
- a pinned file only ever moves to its pin;
- applying the plan and planning again (at the same ``now``) yields nothing.

How a file's tier is chosen
---------------------------
Tiers are ordered fastest first, each with a ``min_heat``. A file wants the fastest tier whose
``min_heat`` its heat reaches. With hysteresis ``h``, a promotion needs ``heat ≥ min_heat·(1+h)``
and a demotion happens only once ``heat < min_heat·(1-h)``; in between the file stays.

Hosts sharing a catalog (a fleet): ``promotion_heat`` says which heat lifts a file off a shared
tier (an object store) onto this host's tiers, this host's own (``local``, the default: each host
warms what it reads) or the fleet's (``fleet``: every host warms what any host reads); see
:mod:`tiering.placement.fleetheat`.

Space: a tier past its high watermark gives up its coldest files until it is under its low
watermark. Promotions fill a tier only up to its low watermark, demotions and pins up to its high
watermark, and nothing ever goes past the free space of the tier's filesystem.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tiering.catalog.db import decay
from tiering.errors import InvalidPolicy

__all__ = [
    "FileView",
    "PlannedMove",
    "Policy",
    "TierPolicy",
    "TierState",
    "default_policy",
    "memory_rule",
]

DAY = 86_400.0
MIB = 1 << 20


class TierPolicy(BaseModel):
    """The rules of one tier."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_heat: float = Field(ge=0, description="Heat a file needs to belong on this tier")
    quota_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Most bytes tierd places here; default the tier's configured quota (if any)",
    )
    high_watermark: float = Field(
        default=0.9, gt=0, le=1, description="Fraction of the quota that triggers demotions"
    )
    low_watermark: float = Field(
        default=0.8, ge=0, le=1, description="Fraction of the quota demotions bring it under"
    )

    @model_validator(mode="after")
    def _marks(self) -> TierPolicy:
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must not be above high_watermark "
                f"({self.high_watermark})"
            )
        return self


class Policy(BaseModel):
    """The policy document (stored as JSON, one row per version).

    Tiers not named in ``tiers`` get no say: use :meth:`for_tiers` to check a document against
    the engine's tiers, which also puts ``tiers`` in rank order.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tiers: dict[str, TierPolicy] = Field(description="Rules per tier, by tier name")
    half_life_s: float = Field(default=DAY, gt=0, description="Heat halves every this many s")
    hysteresis: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        description="Fraction around each threshold inside which a file stays where it is",
    )
    min_age_s: float = Field(
        default=600.0,
        ge=0,
        description="Seconds since a file was written or last moved before policy moves it",
    )
    interval_s: float = Field(default=60.0, ge=0.05, description="Seconds between scheduler passes")
    concurrency: int = Field(default=2, ge=1, le=64, description="Migrations run at once")
    bandwidth_bytes_per_s: int | None = Field(
        default=256 * MIB,
        gt=0,
        description="Cap on all migrations' copy rate together; null for no cap",
    )
    enabled: bool = Field(default=True, description="Whether the scheduler moves files by itself")
    promotion_heat: Literal["local", "fleet"] = Field(
        default="local",
        description=(
            "Which heat brings a file on a shared tier (an object store) up to this host's "
            "tiers: 'local', this host's own accesses, or 'fleet', every host's (the file's "
            "heat in the catalog). A file on a host's own tier has one heat; so does every "
            "file of a catalog only one host writes (SQLite)"
        ),
    )

    @classmethod
    def parse(
        cls, document: object, tier_names: Sequence[str], *, memory: str | None = None
    ) -> Policy:
        """Validate a JSON document against the engine's tiers.

        ``memory`` names the memory tier (the first of ``tier_names``): a document without
        rules for it gets the default ones (see :func:`memory_rule`), so a policy set before
        the memory tier was configured still applies.

        Raises
        ------
        InvalidPolicy
            With every problem spelled out with its location, e.g.
            ``tiers.ssd.min_heat: must be below nvme's min_heat (100)``.
        """
        if not isinstance(document, Mapping):
            raise InvalidPolicy("the policy must be a JSON object")
        tiers = document.get("tiers")
        if memory is not None and isinstance(tiers, Mapping) and memory not in tiers:
            storage = [tiers[n] for n in tier_names if n != memory and n in tiers]
            fastest = (
                storage[0].get("min_heat") if storage and isinstance(storage[0], Mapping) else 0
            )
            if isinstance(fastest, int | float) and not isinstance(fastest, bool):
                rule = memory_rule(float(fastest)).model_dump(mode="json")
                document = {**document, "tiers": {memory: rule, **tiers}}
        try:
            policy = cls.model_validate(dict(document))
        except ValidationError as exc:
            raise InvalidPolicy(_explain(exc)) from None
        return policy.for_tiers(tier_names)

    def for_tiers(self, tier_names: Sequence[str]) -> Policy:
        """This policy with ``tiers`` in rank order, checked against ``tier_names``."""
        problems: list[str] = []
        unknown = [n for n in self.tiers if n not in tier_names]
        missing = [n for n in tier_names if n not in self.tiers]
        if unknown:
            problems.append(
                f"tiers: unknown tier {', '.join(map(repr, unknown))}; "
                f"the tiers are {', '.join(tier_names)}"
            )
        if missing:
            problems.append(f"tiers: missing rules for tier {', '.join(map(repr, missing))}")
        if not problems:
            ordered = [(n, self.tiers[n]) for n in tier_names]
            for (faster, fp), (slower, sp) in zip(ordered, ordered[1:], strict=False):
                if sp.min_heat >= fp.min_heat:
                    problems.append(
                        f"tiers.{slower}.min_heat: must be below {faster}'s min_heat "
                        f"({fp.min_heat:g}), because tiers are ordered fastest first; "
                        f"got {sp.min_heat:g}"
                    )
            last, lp = ordered[-1]
            if lp.min_heat != 0:
                problems.append(
                    f"tiers.{last}.min_heat: must be 0, so the slowest tier takes every file "
                    f"colder than the others; got {lp.min_heat:g}"
                )
        if problems:
            raise InvalidPolicy("; ".join(problems))
        return self.model_copy(update={"tiers": dict(ordered)})

    def without(self, names: Collection[str]) -> Policy:
        """This policy without the rules of ``names``: the storage planner plans over the
        storage tiers alone, never the memory tier (a cache, not a home)."""
        if not any(n in self.tiers for n in names):
            return self
        kept = {n: tp for n, tp in self.tiers.items() if n not in names}
        return self.model_copy(update={"tiers": kept})

    def document(self) -> dict[str, Any]:
        """The policy as a JSON-able document (what ``parse`` accepts)."""
        return self.model_dump(mode="json")


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "invalid"))
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        msg = msg.removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid policy"


def memory_rule(fastest_min_heat: float) -> TierPolicy:
    """The memory tier's default rules: twice the heat of the fastest storage tier's (10 when
    that one takes every file). Its quota is the configured one."""
    return TierPolicy(min_heat=2 * fastest_min_heat if fastest_min_heat > 0 else 10.0)


def default_policy(
    tier_names: Sequence[str], *, half_life_s: float = DAY, memory: str | None = None
) -> Policy:
    """The policy in force until someone sets one.

    For the default tiers this is ≥ 100 → nvme, ≥ 10 → ssd, otherwise hdd. Other tier lists get
    thresholds by rank: the slowest 0, then 10, 100, 1000... towards the fastest. ``memory``
    names the memory tier, first in ``tier_names``: the storage tiers get the thresholds they
    would have without it, and it gets :func:`memory_rule` (≥ 200 above the default tiers).
    """
    storage = [n for n in tier_names if n != memory]
    n = len(storage)
    tiers = {
        name: TierPolicy(min_heat=0.0 if rank == n - 1 else float(10 ** (n - 1 - rank)))
        for rank, name in enumerate(storage)
    }
    if memory is not None:
        tiers = {memory: memory_rule(tiers[storage[0]].min_heat), **tiers}
    return Policy(tiers=tiers, half_life_s=half_life_s)


# -- the planner ---------------------------------------------------------------------------------
class FileView(Protocol):
    """What the planner reads of a file (a catalog ``FileRecord`` is one)."""

    @property
    def id(self) -> int: ...
    @property
    def relpath(self) -> str: ...
    @property
    def tier(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def heat(self) -> float: ...
    @property
    def heat_at(self) -> float: ...
    @property
    def pinned_tier(self) -> str | None: ...
    @property
    def state(self) -> str: ...
    @property
    def updated_at(self) -> float: ...


@dataclass(frozen=True)
class TierState:
    """What the planner knows of a tier right now.

    ``used_bytes`` is what the catalog places on it (files being migrated away included);
    ``free_bytes`` the free space of its filesystem (None: unknown, treated as unlimited);
    ``quota_bytes`` the configured quota, which the policy may override.
    """

    name: str
    used_bytes: int
    free_bytes: int | None = None
    quota_bytes: int | None = None


@dataclass(frozen=True)
class PlannedMove:
    """One move the planner wants, with the reason a person can read."""

    file_id: int
    relpath: str
    src: str
    dst: str
    size: int
    heat: float
    kind: str  # "pin", "promote", "demote" or "watermark"
    reason: str


def heat_now(rec: FileView, policy: Policy, now: float) -> float:
    """A file's heat decayed to ``now`` under ``policy``'s half-life."""
    return decay(rec.heat, rec.heat_at, now, policy.half_life_s)
