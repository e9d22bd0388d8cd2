"""Recovery at start: settle the moves a crash interrupted, before anything is served.

The rule of RELIABILITY.md, decided per open intent from what each side holds now:

- ``copying``: the source is authoritative. The temp goes, and so does a copy at B with the
  source's bytes; the file is ``stable`` on A again.
- ``switched``: B is authoritative. The source goes if it holds the moved bytes, and the
  intent is ``done``.
- When one side is gone and the other holds verified bytes, that side is kept.
- Anything else cannot be decided: nothing is deleted, the file is quarantined and reported.

Only tierd's own temp name for the intent is ever removed outright; a file at its final name
is removed only when its checksum proves it is the moved file and it is still that inode. So a
second run finds nothing to change.

Recovery settles this host's intents only (``Journal.own_open_intents``): another host's open
intent may be a move in flight right now, and its temp and perhaps one side are on tiers only
that host sees. Its own restart settles it.

:func:`settle` applies the same rule while tierd runs, once the catalog's database answers
again after an outage: a move cut by the outage (its switch's outcome unknown, or its abort or
its ``done`` not recorded) left its intent open and its file ``migrating``. It settles only the
intents no live move of this process holds: it takes each file's guard
(:class:`~tiering.moves.concurrency.FileGuards`, shared by the scheduler's moves, manual ones,
prefetches, uploads and deletes) without waiting, skips a file whose guard is held (that move
closes its own intent), and reads the intent again under the guard, as the move may have closed
it in between. A catalog that fails again stops it (:class:`~tiering.errors.CatalogUnreachable`)
with nothing half-done: the intents not yet settled wait for the next call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tiering.catalog import Catalog, Migration, MigrationPhase
from tiering.catalog.journal import Journal
from tiering.errors import CatalogUnreachable, FileBusy, IntegrityError, TierdError, TierNotFound
from tiering.moves.concurrency import FileGuards
from tiering.moves.steps import temp_stem
from tiering.tiers import Stat, Tier, Tiers

__all__ = ["RecoveryReport", "recover", "settle"]

log = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    """What one :func:`recover` run did, by intent id (file ids for ``unstuck``)."""

    aborted: list[int] = field(default_factory=list)  # copying: source kept
    finished: list[int] = field(default_factory=list)  # switched: source removed
    relocated: list[int] = field(default_factory=list)  # only one side survived: kept that one
    quarantined: list[int] = field(default_factory=list)  # undecidable: nothing deleted
    unstuck: list[int] = field(default_factory=list)  # migrating files with no intent

    @property
    def changed(self) -> bool:
        return bool(
            self.aborted or self.finished or self.relocated or self.quarantined or self.unstuck
        )


def recover(catalog: Catalog, journal: Journal, tiers: Tiers) -> RecoveryReport:
    """Settle every intent of this host a crash left open, by the rule above; run before
    serving.

    Idempotent: a second run finds no open intent and reports nothing
    (``RecoveryReport.changed`` is False).
    """
    report = RecoveryReport()
    for intent in journal.own_open_intents():
        _settle_one(catalog, journal, tiers, intent, report)
    report.unstuck = journal.unstick()
    return report


def settle(catalog: Catalog, journal: Journal, tiers: Tiers, guards: FileGuards) -> RecoveryReport:
    """Settle this host's open intents that no live move of this process holds, by the rule
    above, while serving (see the module docstring); :func:`recover` is the same at start.

    Idempotent: a second run finds nothing to change. Skipped intents (their file's guard was
    held) are not reported: their move closes them.

    Raises
    ------
    CatalogUnreachable
        The database failed again; the intents not settled yet wait for the next call.
    """
    report = RecoveryReport()
    for intent in journal.own_open_intents():
        fid = intent.file_id
        if fid is not None:
            try:
                guards.acquire(fid, "recovered")
            except FileBusy:
                continue  # a live move of this process: it closes its own intent
        try:
            now = journal.get(intent.id)  # under the guard: the move may have closed it since
            if now is not None and now.phase in MigrationPhase.OPEN:
                log.warning(
                    "migration %d of %r was left %s by a catalog outage; settling it",
                    now.id,
                    now.relpath,
                    now.phase,
                )
                _settle_one(catalog, journal, tiers, now, report)
        finally:
            if fid is not None:
                guards.release(fid)
    report.unstuck = journal.unstick()
    return report


def _settle_one(
    catalog: Catalog, journal: Journal, tiers: Tiers, intent: Migration, report: RecoveryReport
) -> None:
    try:
        _recover(catalog, journal, tiers, intent, report)
    except CatalogUnreachable:
        raise  # not a reason to quarantine: the same intent is settled once it answers
    except (OSError, TierdError) as exc:
        why = f"recovery could not decide: {exc}; nothing was deleted"
        log.error("migration %d of %r: %s", intent.id, intent.relpath, why)
        journal.quarantine(intent, error=why)
        report.quarantined.append(intent.id)


def _recover(
    catalog: Catalog, journal: Journal, tiers: Tiers, intent: Migration, report: RecoveryReport
) -> None:
    """Settle one intent; an error means it could not even look, and ``recover`` quarantines."""
    try:
        src, dst = tiers.get(intent.src_tier), tiers.get(intent.dst_tier)
    except TierNotFound as exc:
        raise IntegrityError(f"tier no longer configured: {exc.message}") from exc
    rec = catalog.find(intent.relpath)
    if rec is None or rec.id != intent.file_id:
        # The file was deleted: only the temp is ours for sure.
        _remove_temp(dst, intent)
        journal.release(intent, phase=MigrationPhase.ABORTED, error="file deleted")
        report.aborted.append(intent.id)
        return
    sides = _Sides(src, dst, rec.checksum, src.probe(intent.relpath), dst.probe(intent.relpath))
    if intent.phase == MigrationPhase.COPYING:
        settled = _settle_copying(journal, intent, sides, report)
    elif intent.phase == MigrationPhase.SWITCHED:
        settled = _settle_switched(journal, intent, sides, report)
    else:
        settled = False
    if not settled:
        why = (
            f"recovery of a {intent.phase} move could not decide which copy is right "
            f"({sides.described()}, neither both verified against {rec.checksum}); "
            "nothing was deleted"
        )
        log.error("migration %d of %r: %s", intent.id, intent.relpath, why)
        journal.quarantine(intent, error=why)
        report.quarantined.append(intent.id)


@dataclass(frozen=True)
class _Sides:
    """The two tiers of an interrupted move, what each holds of the file now (its checksum
    and stat, or None), and the checksum the catalog expects (None: not recorded)."""

    src: Tier
    dst: Tier
    expected: str | None
    a: tuple[str, Stat] | None
    b: tuple[str, Stat] | None

    def verified(self, side: tuple[str, Stat] | None) -> bool:
        return side is not None and side[0] == self.expected

    def described(self) -> str:
        where = ["absent" if s is None else "present" for s in (self.a, self.b)]
        return f"source {where[0]}, destination {where[1]}"


def _settle_copying(journal: Journal, intent: Migration, s: _Sides, report: RecoveryReport) -> bool:
    """A move cut off while copying: the source is kept (the copy goes) unless it was lost
    and the destination holds a verified copy. False: neither is sure."""
    a, b = s.a, s.b
    if a is not None and (s.expected is None or a[0] == s.expected):
        _remove_temp(s.dst, intent)
        if b is not None and b[0] == a[0]:
            s.dst.remove(intent.relpath, version=b[1].version)
        elif b is not None:
            log.warning(
                "%r on tier %s differs from the source; left for a person",
                intent.relpath,
                s.dst.name,
            )
        _keep(journal, intent, s.src, a, MigrationPhase.ABORTED, _KEPT_SOURCE, checksum=a[0])
        report.aborted.append(intent.id)
        return True
    if a is None and s.expected is not None and b is not None and s.verified(b):
        _remove_temp(s.dst, intent)
        _keep(journal, intent, s.dst, b, MigrationPhase.DONE, _KEPT_DESTINATION)
        report.relocated.append(intent.id)
        return True
    return False


def _settle_switched(
    journal: Journal, intent: Migration, s: _Sides, report: RecoveryReport
) -> bool:
    """A move cut off after its switch: it is finished (the source goes) where the destination
    holds the verified copy, else the source is kept if it is verified. False: neither is."""
    a, b = s.a, s.b
    if s.verified(b):
        _remove_temp(s.dst, intent)
        if a is not None and a[0] == s.expected:
            s.src.remove(intent.relpath, version=a[1].version)
        elif a is not None:
            log.warning(
                "%r on tier %s is not the moved file; left for a person",
                intent.relpath,
                s.src.name,
            )
        journal.finish(intent.id)
        report.finished.append(intent.id)
        return True
    if b is None and a is not None and s.verified(a):
        _remove_temp(s.dst, intent)
        _keep(journal, intent, s.src, a, MigrationPhase.FAILED, _LOST_DESTINATION)
        report.relocated.append(intent.id)
        return True
    return False


_KEPT_SOURCE = "interrupted by a restart; the source was kept"
_KEPT_DESTINATION = "the source was lost; the verified copy at the destination was kept"
_LOST_DESTINATION = "the copy at the destination was lost after the switch; the source was kept"


def _keep(
    journal: Journal,
    intent: Migration,
    tier: Tier,
    side: tuple[str, Stat],
    phase: str,
    error: str,
    *,
    checksum: str | None = None,
) -> None:
    """Record that the file's authoritative copy is ``side``, on ``tier``."""
    stat = side[1]
    journal.relocate(
        intent,
        tier=tier.name,
        phase=phase,
        error=error,
        checksum=checksum,
        mtime_ns=stat.mtime_ns,
        etag=stat.etag,
        codec=stat.codec,
        stored_size=stat.stored_size,
    )


def _remove_temp(tier: Tier, intent: Migration) -> bool:
    """Remove what the intent's writer left unpublished (its temp file, or its unfinished
    multipart upload); only that is ours for sure."""
    return tier.remove_temp(intent.relpath, temp_stem(intent.temp_name))
