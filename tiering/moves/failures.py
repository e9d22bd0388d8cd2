"""How a move fails: the public :class:`Cancelled`, the internal :class:`Abort` signal, the
one place where an ``OSError`` from a tier becomes a :class:`~tiering.errors.TierdError`, and
the undo and journal record of an aborted move.

Errors from the filesystem are translated here and nowhere else, so every step of a move (and
every abort it records) names the same error for the same errno.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from tiering.catalog import FileState, Migration, MigrationPhase
from tiering.catalog.journal import Journal
from tiering.errors import CatalogBusy, InsufficientSpace, StorageError, TierdError, Unavailable
from tiering.tiers import Published, Tier

__all__ = [
    "Abort",
    "Cancelled",
    "public_error",
    "record_abort",
    "retry_busy",
    "storage_error",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Cancelled(Unavailable):
    """The move was abandoned because the engine is stopping."""

    code = "cancelled"


class Abort(Exception):
    """Internal: stop the move, give the file ``state`` and close the intent as ``phase``.

    Never leaves :mod:`tiering.moves`: the caller of a move sees :attr:`error` instead (see
    :func:`public_error`). ``phase="unknown"`` means the commit point's outcome is unknown, so
    the abort deletes nothing and leaves the intent open for recovery.
    """

    def __init__(
        self, error: TierdError, state: str = FileState.STABLE, phase: str = MigrationPhase.ABORTED
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.state = state
        self.phase = phase


def storage_error(exc: OSError, where: str) -> TierdError:
    """The public error for ``exc``; ``where`` says what the move was doing."""
    # Out of space (or quota) is the caller's to fix by freeing room, not a failing disk.
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientSpace(f"{where}: out of space ({exc.strerror})")
    return StorageError(f"{where}: {exc.strerror or exc} (errno {exc.errno})", errno=exc.errno)


def public_error(exc: BaseException) -> BaseException:
    """What the caller of a move sees for ``exc``: internal signals and OS errors translated."""
    if isinstance(exc, Abort):
        return exc.error
    if isinstance(exc, OSError):
        return storage_error(exc, "migration")
    return exc


def retry_busy(fn: Callable[[], T], tries: int = 3) -> T:
    """Run a catalog write, retrying a few times while the catalog is busy; returns what it
    returned (the last try's error is raised)."""
    for i in range(tries - 1):
        try:
            return fn()
        except CatalogBusy:
            time.sleep(0.1 * (i + 1))
    return fn()


def record_abort(
    journal: Journal,
    intent: Migration,
    exc: BaseException,
    dst: Tier,
    published: Published | None,
    *,
    copied: int | None,
) -> None:
    """Undo what a failed move made at ``dst`` and close its intent with the error.

    Before the switch the source is authoritative, so the published copy (if any) goes; the
    file gets the state and the intent the phase that ``exc`` asks for (:class:`Abort`), or
    stable/aborted for any other error. A failure to record is logged and left to recovery.
    """
    if isinstance(exc, Abort) and exc.phase == "unknown":
        return  # commit state uncertain: delete nothing, leave the intent to recovery
    if published is not None:
        _remove_published(dst, intent.relpath, published)
    err: BaseException
    if isinstance(exc, Abort):
        state, phase, err = exc.state, exc.phase, exc.error
    else:
        state, phase = FileState.STABLE, MigrationPhase.ABORTED
        err = public_error(exc)
    text = err.message if isinstance(err, TierdError) else str(err)
    detail = text if state != FileState.STABLE else None
    message = f"{type(err).__name__}: {text}"
    try:
        retry_busy(
            lambda: journal.release(
                intent,
                phase=phase,
                error=message,
                state=state,
                detail=detail,
                bytes_copied=copied,
            )
        )
    except Exception:
        log.exception("migration %d: could not record the abort; recovery will", intent.id)
    log.warning("migration %d of %r aborted: %s", intent.id, intent.relpath, message)


def _remove_published(tier: Tier, relpath: str, pub: Published) -> None:
    """Remove an aborted move's published copy, if ``relpath`` still holds that version.

    Runs while an abort is already under way, so a failure is logged, not raised: the abort
    must still be recorded, and the source is untouched either way.
    """
    try:
        tier.remove(relpath, version=pub.stat.version)
    except (OSError, TierdError) as exc:
        log.error("could not remove the aborted copy of %r on %s: %s", relpath, tier.name, exc)
