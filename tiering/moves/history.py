"""What is shown of a migration: its journal row, with live progress while it is in flight."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tiering.catalog import Migration, MigrationPhase
from tiering.moves.mover import Mover

__all__ = ["MigrationInfo"]


@dataclass(frozen=True)
class MigrationInfo:
    """One migration, from the journal, with live progress while it is in flight."""

    record: Migration
    bytes_copied: int

    @classmethod
    def of(cls, row: Migration, mover: Mover) -> MigrationInfo:
        """``row`` with the mover's live byte count while it is in flight: the journal records
        the count only when the move switches or ends."""
        live = mover.progress().get(row.id) if row.phase in MigrationPhase.OPEN else None
        return cls(row, live if live is not None else row.bytes_copied)

    @property
    def in_flight(self) -> bool:
        return self.record.phase in MigrationPhase.OPEN

    @property
    def duration_s(self) -> float | None:
        end = self.record.finished_at
        if end is None:
            return time.time() - self.record.started_at if self.in_flight else None
        return max(0.0, end - self.record.started_at)
