"""The policy in force: the built-in default until one is stored, then the newest stored version,
picked up again whenever another process (or another engine) stores a newer one."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tiering.catalog.policies import PolicyStore, StoredPolicy
from tiering.errors import InvalidInput, Unavailable
from tiering.placement.policy import Policy, default_policy
from tiering.tiers import Tier

__all__ = ["CurrentPolicy", "PolicyInfo"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicyInfo:
    """The policy in force; version 0 is the built-in default, never set by anyone."""

    version: int
    policy: Policy
    created_at: float | None
    author: str | None


class CurrentPolicy:
    """Holds the policy in force and keeps it in step with the stored versions.

    Parameters
    ----------
    tier_names:
        The configured tiers, fastest first; every policy is validated against them.
    half_life_s:
        The built-in default policy's half-life.
    memory:
        The memory tier's name (first of ``tier_names``), if one is configured.
    """

    def __init__(
        self, tier_names: list[str], *, half_life_s: float, memory: str | None = None
    ) -> None:
        self.tier_names = tier_names
        self.memory = memory
        #: Where versions are stored, set when the catalog opens. Until then the default is in
        #: force, which is all that heat and quotas need.
        self.store: PolicyStore | None = None
        default = default_policy(tier_names, half_life_s=half_life_s, memory=memory)
        self._info = PolicyInfo(0, default, None, None)

    @property
    def info(self) -> PolicyInfo:
        """The policy in force with its version."""
        return self._info

    @property
    def policy(self) -> Policy:
        """The policy in force."""
        return self._info.policy

    def quota(self, tier: Tier) -> int | None:
        """A tier's quota: the policy's, else the configured one (None: no quota)."""
        tp = self._info.policy.tiers.get(tier.name)
        if tp is not None and tp.quota_bytes is not None:
            return tp.quota_bytes
        return tier.quota_bytes

    def reload(self) -> PolicyInfo:
        """Pick up the newest stored version (cheap when it did not change)."""
        store = self._store()
        if store.latest_version() != self._info.version:
            stored = store.latest()
            if stored is not None:
                self._apply(stored)
        return self._info

    def set(self, document: object, *, author: str | None = None) -> PolicyInfo:
        """Validate and store a policy document as the next version, and put it in force.

        Raises
        ------
        InvalidPolicy
            The document does not validate (nothing is stored).
        """
        policy = self.parse(document)
        stored = self._store().save(policy.document(), author=author)
        self._info = PolicyInfo(stored.version, policy, stored.created_at, stored.author)
        return self._info

    def parse(self, document: object) -> Policy:
        """Validate ``document`` against these tiers (see :meth:`Policy.parse`)."""
        return Policy.parse(document, self.tier_names, memory=self.memory)

    def _apply(self, stored: StoredPolicy) -> None:
        try:
            policy = self.parse(stored.document)
        except InvalidInput as exc:
            # Stored under another tier list: keep serving with the current one, loudly.
            log.error("stored policy version %d does not fit these tiers: %s", stored.version, exc)
            return
        self._info = PolicyInfo(stored.version, policy, stored.created_at, stored.author)

    def _store(self) -> PolicyStore:
        if self.store is None:
            raise Unavailable("the policy store is not open")
        return self.store
