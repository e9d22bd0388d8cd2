"""A host copy written from pieces: the fill (:class:`~tiering.copies.piecefill.PieceFill`)
into a copies area's writer, ended by the writer's checked publish, and this host's piece
bookkeeping in the catalog around it (its holdings, its claim on the bucket, the map).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from tiering.catalog import FileRecord
from tiering.copies.piecefill import FleetFills, PieceFill
from tiering.errors import FileChanged, IntegrityError
from tiering.tiers import Published, Source, Tier

__all__ = ["reset_holdings", "write_from_pieces"]

log = logging.getLogger(__name__)


def write_from_pieces(
    fleet: FleetFills,
    rec: FileRecord,
    area: Tier,
    name: str,
    *,
    open_origin: Callable[[], Source],
    stop: Callable[[], bool],
    throttle: Callable[[int], None] | None,
    progress: Callable[[int], None] | None,
    sources: Callable[[str, int], None] | None,
    serving: Callable[[PieceFill | None], None],
) -> Published:
    """Write ``rec``'s copy ``name`` into copies area ``area`` from pieces (a
    :class:`PieceFill`, handed to ``serving`` while it may relay, and ``serving(None)`` after),
    ended by the writer's checked publish, as :func:`~tiering.copies.copyfiles.write_copy`
    does. On failure this host's holding and bucket claim go; a whole-file checksum that
    failed also drops the unfinished map whose digests came from those bytes."""
    pieces = fleet.pieces
    fill: PieceFill | None = None
    try:
        with area.writer(name, overwrite=True, checksum=rec.checksum) as w:
            fill = PieceFill(
                fleet,
                rec,
                w,
                open_origin,
                stop=stop,
                throttle=throttle,
                progress=progress,
                sources=sources,
            )
            serving(fill)
            try:
                fill.run()
            finally:
                serving(None)
                fill.close()
            if w.size != rec.size:
                raise FileChanged(f"{rec.relpath!r} is {w.size} bytes, the catalog says {rec.size}")
            try:
                published = w.publish()
            except IntegrityError:
                _quietly(lambda: pieces.drop_unfinished(rec.id, rec.generation))
                raise
    except BaseException:
        _quietly(lambda: pieces.forget(rec.id, host=fleet.host))
        raise
    finally:
        if fill is not None and fill.claimed:
            _quietly(lambda: pieces.release_origin(rec.id, host=fleet.host))
    _quietly(lambda: pieces.finalize(rec.id, rec.generation))
    return published


def _quietly(step: Callable[[], object]) -> None:
    """A catalog step whose failure (an outage) must not hide the fill's own outcome: a
    holding left behind names a host that no longer answers for it (receivers skip it after a
    404), and an unreleased claim expires."""
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - logged; the fill's own result stands
        log.warning("piece bookkeeping failed: %s", exc)


def reset_holdings(fleet: FleetFills, kept: Iterable[tuple[int, int]]) -> None:
    """At start: this host's holdings are exactly its ``kept`` copies' (file id, generation),
    each whole (a fill cut short by a crash left a holding of a temp that recovery swept)."""
    pieces = fleet.pieces
    pieces.forget_host(fleet.host)
    for file_id, generation in kept:
        m = pieces.map(file_id, generation)
        if m is not None:
            pieces.mark(file_id, host=fleet.host, generation=generation, verified=range(m.count))
