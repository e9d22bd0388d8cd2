"""Damage: stored bytes that fail their check (a container's chunk against its digest, a
footer that does not parse), found by a read, a move or a scan.

Damage is not a change: the file is quarantined once, with the reason, and left alone (nothing
is deleted; a person restores it by uploading it again or deleting it). :class:`DamageLog` is
this process's list of what it found, for ``/readyz``, ``/metrics`` and the scan, which must
not hash a damaged file again on every pass (the watcher would otherwise retry it forever): a
file is skipped while it is the version found damaged, and looked at again once it changes.
The catalog's record (``quarantined``, ``detail`` "damaged: ...") is what outlives the process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tiering.errors import IntegrityError

__all__ = ["DAMAGED", "Damage", "DamageLog", "version_of"]

log = logging.getLogger(__name__)

#: How a quarantined record's ``detail`` begins when its bytes were found damaged.
DAMAGED = "damaged: "


def version_of(stored_size: int, mtime_ns: int, etag: str | None) -> str:
    """Which version of a file this is, as the damage log tells them apart: an object's ETag,
    or a local file's stored size and mtime (what a walk lists, no file opened)."""
    return etag or f"{stored_size}:{mtime_ns}"


@dataclass(frozen=True)
class Damage:
    """One damaged file: where, which version of it (its stored size and mtime, or ETag), why,
    when it was found, and its record if it has one."""

    tier: str
    relpath: str
    version: str
    reason: str
    found_at: float
    file_id: int | None = None


class DamageLog:
    """What this process found damaged (thread-safe). ``failures`` counts every finding, a
    file found again in a later version too (``tierd_integrity_failures_total``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._found: dict[tuple[str, str], Damage] = {}
        self.failures = 0

    def note(
        self,
        tier: str,
        relpath: str,
        version: str,
        exc: IntegrityError,
        *,
        file_id: int | None = None,
        quarantine: Callable[[int, str], object] | None = None,
    ) -> bool:
        """Record damage to ``relpath`` (this ``version``) on ``tier``; True the first time
        (the caller's one warning line is then logged here), False for a version already
        known. ``quarantine(file_id, detail)`` marks the record, once."""
        reason = exc.message
        with self._lock:
            known = self._found.get((tier, relpath))
            if known is not None and known.version == version:
                return False
            self._found[(tier, relpath)] = Damage(
                tier, relpath, version, reason, time.time(), file_id
            )
            self.failures += 1
        log.warning("damaged: %r on tier %s: %s; quarantined", relpath, tier, reason)
        if file_id is not None and quarantine is not None:
            quarantine(file_id, DAMAGED + reason)
        return True

    def known(self, tier: str, relpath: str, version: str) -> Damage | None:
        """What was found, if this version of the file is known damaged."""
        with self._lock:
            d = self._found.get((tier, relpath))
            return d if d is not None and d.version == version else None

    def clear(self, tier: str, relpath: str) -> None:
        """The file is gone, or read back sound (a new version)."""
        with self._lock:
            self._found.pop((tier, relpath), None)

    def keep_only(self, found: set[tuple[str, str]]) -> None:
        """After a full scan: only the ``(tier, relpath)`` it found damaged still are."""
        with self._lock:
            for key in [k for k in self._found if k not in found]:
                del self._found[key]

    def items(self) -> list[Damage]:
        with self._lock:
            return sorted(self._found.values(), key=lambda d: (d.tier, d.relpath))
