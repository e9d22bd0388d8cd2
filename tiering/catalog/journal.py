"""The migration journal: intents, the switch that commits a move, and pins.

Every change here is a compare-and-set inside one write transaction: on the record's state and
generation, and on the intent's phase. A claim does not bump the generation; everything that
changes a file's place or content does, so a move loses to any such change that slips in.

On PostgreSQL, where movers on several hosts write at once, each transaction locks the file's
record before it reads it, then the intent's row (the same order everywhere, so two of them
wait for each other rather than deadlock): the compare-and-set reads the last committed values,
and of two claims of one file the second waits for the first and sees it ``migrating``.

Each intent names the host that claimed it (``Migration.host``). Hosts share a catalog but not
their directory tiers, and a move's temp lives on its destination: only the claiming host can
settle what a crash left, so recovery reads :meth:`Journal.own_open_intents` alone. A file of
another host's open intent stays busy for everyone (scan, watcher, claims): it is in flight.

Kept whole past 450 lines: every write of the move protocol is a CAS over the same rows.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import ColumnElement, func, or_, select, update
from sqlalchemy.orm import Session

from tiering.catalog.backends import FOR_WRITE, relax_commit
from tiering.catalog.db import Database
from tiering.catalog.models import (
    FileRecord,
    FileState,
    Migration,
    MigrationPhase,
    owned_file_ids,
)
from tiering.errors import Conflict, FileBusy, FileNotFound
from tiering.tiers.paths import TEMP_SUFFIX

__all__ = ["Journal", "SwitchOutcome", "refuse_other_host", "temp_name_for"]


def temp_name_for(file_id: int, intent_id: int) -> str:
    """The temp file name of one migration: ``.<file_id>.<intent_id>.tierd-tmp``."""
    return f".{file_id}.{intent_id}{TEMP_SUFFIX}"


def _files(intent: Migration) -> tuple[int, ...] | None:
    """What a write of ``intent``'s file changes: its record alone (None: unknown, so all)."""
    return None if intent.file_id is None else (intent.file_id,)


def _locked(s: Session, intent: Migration) -> tuple[FileRecord | None, Migration | None]:
    """The intent's file record and its row, locked in that order (see the module docstring)."""
    rec = (
        s.get(FileRecord, intent.file_id, with_for_update=FOR_WRITE)
        if intent.file_id is not None
        else None
    )
    return rec, s.get(Migration, intent.id, with_for_update=FOR_WRITE)


def refuse_other_host(db: Database, rec: FileRecord, action: str) -> None:
    """Raise :class:`Conflict` when ``rec`` is on another host's own tier: its bytes are on
    that host's disk, which this one cannot reach, so moving, replacing or deleting it here
    would act on this host's tier of the same name and leave the record wrong."""
    if db.single_writer or db.host is None or rec.host in (None, db.host):
        return  # SQLite: one host, whose records were adopted at start; or no host identity
    raise Conflict(
        f"{rec.relpath!r} is on host {rec.host}'s tier {rec.tier}: only that host can {action} it",
        file_id=rec.id,
        host=rec.host,
        tier=rec.tier,
    )


@dataclass(frozen=True)
class SwitchOutcome:
    committed: bool
    record: FileRecord | None


class Journal:
    """Migration intents and history over one :class:`Database`.

    Parameters
    ----------
    db:
        The catalog.
    host:
        This host's id (``EngineConfig.host_id``), written on every intent it claims; the
        hostname when not given.
    """

    def __init__(self, db: Database, *, host: str | None = None) -> None:
        self.db = db
        self.host = host if host is not None else socket.gethostname()

    # -- the protocol's transactions ---------------------------------------------------------
    def claim(
        self,
        file_id: int,
        dst_tier: str,
        *,
        reason: str,
        expected_generation: int | None = None,
        now: float | None = None,
    ) -> tuple[Migration, FileRecord]:
        """Step 1: check the file and write the intent, in one transaction.

        Raises
        ------
        FileNotFound
            No such file.
        FileBusy
            It is not ``stable`` (migrating, quarantined...), it changed since the caller read
            it, or it is pinned to another tier.
        Conflict
            It is already on ``dst_tier``, or on another host's own tier.
        """
        now = time.time() if now is None else now

        def body(s: Session) -> tuple[Migration, FileRecord]:
            rec = s.get(FileRecord, file_id, with_for_update=FOR_WRITE)
            if rec is None:
                raise FileNotFound(f"no file with id {file_id}", file_id=file_id)
            refuse_other_host(self.db, rec, "move")
            if rec.state == FileState.MIGRATING:
                raise FileBusy(f"file {file_id} is already being migrated", file_id=file_id)
            if rec.state != FileState.STABLE:
                raise FileBusy(
                    f"file {file_id} is {rec.state} ({rec.detail or 'no detail'}); "
                    "only stable files move",
                    file_id=file_id,
                )
            if expected_generation is not None and rec.generation != expected_generation:
                raise FileBusy(f"file {file_id} changed since it was planned", file_id=file_id)
            if rec.pinned_tier is not None and rec.pinned_tier != dst_tier:
                raise FileBusy(
                    f"file {file_id} is pinned to {rec.pinned_tier}; unpin it first",
                    file_id=file_id,
                    pinned_tier=rec.pinned_tier,
                )
            if rec.tier == dst_tier:
                raise Conflict(f"file {file_id} is already on tier {dst_tier}", file_id=file_id)
            intent = Migration(
                file_id=rec.id,
                relpath=rec.relpath,
                src_tier=rec.tier,
                dst_tier=dst_tier,
                temp_name="",
                host=self.host,
                phase=MigrationPhase.COPYING,
                reason=reason,
                size=rec.size,
                bytes_copied=0,
                generation=rec.generation,
                started_at=now,
            )
            s.add(intent)
            s.flush()
            intent.temp_name = temp_name_for(rec.id, intent.id)
            rec.state = FileState.MIGRATING
            rec.detail = f"migrating {rec.tier} → {dst_tier} (migration {intent.id})"
            s.flush()
            return intent, rec

        # The write changes this file's record alone: every other cached record stays valid.
        return self.db.transact(body, files=(file_id,))

    def switch(
        self,
        intent: Migration,
        *,
        checksum: str,
        size: int,
        mtime_ns: int,
        etag: str | None = None,
        codec: str | None = None,
        stored_size: int | None = None,
        now: float | None = None,
    ) -> SwitchOutcome:
        """Step 8, the commit point: the file is on the destination from here on (stored as
        ``codec`` in ``stored_size`` bytes there, where not as it is).

        A compare-and-set: only if the record is still ``migrating`` at the intent's generation
        and the intent still ``copying``. ``committed`` is False when someone else won.
        """
        now = time.time() if now is None else now

        def body(s: Session) -> SwitchOutcome:
            rec, row = _locked(s, intent)
            if (
                rec is None
                or row is None
                or rec.state != FileState.MIGRATING
                or rec.generation != intent.generation
                or row.phase != MigrationPhase.COPYING
            ):
                return SwitchOutcome(False, rec)
            rec.tier = intent.dst_tier
            rec.host = self.db.owner_of(intent.dst_tier)
            rec.state = FileState.STABLE
            rec.generation += 1
            rec.checksum = checksum
            rec.size = size
            rec.mtime_ns = mtime_ns
            rec.etag = etag
            rec.codec, rec.stored_size = codec, stored_size
            rec.detail = None
            rec.updated_at = now
            row.phase = MigrationPhase.SWITCHED
            row.bytes_copied = size
            s.flush()
            return SwitchOutcome(True, rec)

        return self.db.transact(body, files=_files(intent))

    def finish(
        self, intent_id: int, *, error: str | None = None, now: float | None = None
    ) -> Migration | None:
        """Step 10: a switched intent becomes ``done``; returns it as committed (no read after)."""

        def body(s: Session) -> Migration | None:
            if not self.db.single_writer:
                # Losing ``done`` in a crash is harmless: recovery finds the intent switched,
                # finds the source gone, and marks it done again.
                relax_commit(s)
            row = s.get(Migration, intent_id, with_for_update=FOR_WRITE)
            if row is not None and row.phase == MigrationPhase.SWITCHED:
                row.phase = MigrationPhase.DONE
                row.error = error
                row.finished_at = time.time() if now is None else now
            return row

        return self.db.transact(body, changes_files=False)  # the intent's row only

    def release(
        self,
        intent: Migration,
        *,
        phase: str,
        error: str | None,
        state: str = FileState.STABLE,
        detail: str | None = None,
        bytes_copied: int | None = None,
        now: float | None = None,
    ) -> bool:
        """Close a ``copying`` intent that did not switch (aborted or failed).

        The record gets ``state`` back only if the intent still owns it: the intent is still
        open, and the record ``migrating`` at the intent's generation. (A claim keeps the
        generation, so an intent that someone else closed must not free the record of the
        intent that claimed the file after it.) Returns whether it did.
        """
        now = time.time() if now is None else now

        def body(s: Session) -> bool:
            rec, row = _locked(s, intent)
            if row is None or row.phase not in MigrationPhase.OPEN:
                return False
            row.phase = phase
            row.error = error
            row.finished_at = now
            if bytes_copied is not None:
                row.bytes_copied = bytes_copied
            if (
                rec is not None
                and rec.state == FileState.MIGRATING
                and rec.generation == intent.generation
            ):
                rec.state = state
                rec.detail = detail
                rec.updated_at = now
                return True
            return False

        return self.db.transact(body, files=_files(intent))

    def relocate(
        self,
        intent: Migration,
        *,
        tier: str,
        phase: str,
        error: str | None,
        checksum: str | None = None,
        mtime_ns: int | None = None,
        etag: str | None = None,
        codec: str | None = None,
        stored_size: int | None = None,
        now: float | None = None,
    ) -> None:
        """Recovery's decision for a file whose authoritative copy is on ``tier``.

        ``mtime_ns``, ``etag``, ``codec`` and ``stored_size`` are the kept copy's, when
        recovery looked at it.
        """
        now = time.time() if now is None else now

        def body(s: Session) -> None:
            rec, row = _locked(s, intent)
            if row is not None:
                row.phase = phase
                row.error = error
                row.finished_at = now
            if rec is not None:
                if rec.tier != tier:
                    rec.tier = tier
                    rec.generation += 1
                # Recovery runs on the intent's host, whose tiers these are.
                rec.host = self.db.owner_of(tier)
                if checksum is not None:
                    rec.checksum = checksum
                if mtime_ns is not None:
                    rec.mtime_ns = mtime_ns
                    rec.etag = etag
                    rec.codec, rec.stored_size = codec, stored_size
                rec.state = FileState.STABLE
                rec.detail = None
                rec.updated_at = now

        self.db.transact(body)

    def quarantine(self, intent: Migration, *, error: str, now: float | None = None) -> None:
        """Recovery could not decide: the file is quarantined, the intent failed."""
        now = time.time() if now is None else now

        def body(s: Session) -> None:
            rec, row = _locked(s, intent)
            if row is not None:
                row.phase = MigrationPhase.FAILED
                row.error = error
                row.finished_at = now
            if rec is not None:
                rec.state = FileState.QUARANTINED
                rec.detail = error
                rec.updated_at = now

        self.db.transact(body)

    def unstick(self, now: float | None = None) -> list[int]:
        """Records left ``migrating`` with no open intent (never expected) go back to stable."""
        now = time.time() if now is None else now

        def body(s: Session) -> list[int]:
            stuck = list(
                s.scalars(
                    select(FileRecord)
                    .where(
                        FileRecord.state == FileState.MIGRATING,
                        FileRecord.id.not_in(owned_file_ids()),
                    )
                    .order_by(FileRecord.id)
                    .with_for_update(**FOR_WRITE)
                )
            )
            # Under READ COMMITTED the subquery above read intents as they were when the
            # statement began: a claim that committed while we waited for its record's lock
            # shows here, and that record is not stuck.
            owned = set(s.scalars(owned_file_ids()))
            stuck = [r for r in stuck if r.id not in owned and r.state == FileState.MIGRATING]
            for rec in stuck:
                rec.state = FileState.STABLE
                rec.detail = None
                rec.updated_at = now
            return [r.id for r in stuck]

        return self.db.transact(body)

    # -- pins --------------------------------------------------------------------------------
    def pin(self, file_id: int, tier: str | None) -> FileRecord:
        """Pin a file to ``tier`` (None: unpin). A file in flight to another tier is busy."""
        return self.pin_many([file_id], tier)[0]

    def pin_many(self, file_ids: Sequence[int], tier: str | None) -> list[FileRecord]:
        """Pin (or unpin) every file of ``file_ids`` in one transaction: all, or none when one
        is missing or busy (a model's files are pinned together)."""

        def body(s: Session) -> list[FileRecord]:
            q = select(FileRecord).where(FileRecord.id.in_(list(file_ids)))
            q = q.order_by(FileRecord.id).with_for_update(**FOR_WRITE)
            locked = {r.id: r for r in s.scalars(q)}
            out: list[FileRecord] = []
            for file_id in file_ids:
                rec = locked.get(file_id)
                if rec is None:
                    raise FileNotFound(f"no file with id {file_id}", file_id=file_id)
                if tier is not None and rec.state == FileState.MIGRATING:
                    row = s.scalar(
                        select(Migration).where(
                            Migration.file_id == file_id, Migration.phase.in_(MigrationPhase.OPEN)
                        )
                    )
                    if row is None or row.dst_tier != tier:
                        raise FileBusy(
                            f"file {file_id} is being migrated to "
                            f"{row.dst_tier if row else 'another tier'}; pin it when that is done",
                            file_id=file_id,
                        )
                # A pin names where the file belongs; it changes neither place nor content, so
                # the generation stays and a move to the pinned tier in flight carries on.
                rec.pinned_tier = tier
                out.append(rec)
            s.flush()
            return out

        return self.db.transact(body)

    # -- reads -------------------------------------------------------------------------------
    def get(self, intent_id: int) -> Migration | None:
        with self.db.read() as s:
            return s.get(Migration, intent_id)

    def open_intents(self) -> list[Migration]:
        with self.db.read() as s:
            q = select(Migration).where(Migration.phase.in_(MigrationPhase.OPEN))
            return list(s.scalars(q.order_by(Migration.id)))

    def own_open_intents(self) -> list[Migration]:
        """This host's open intents, oldest first: what its recovery settles. Open intents of
        no host (written before hosts were recorded) are adopted first (:meth:`adopt_legacy`)."""
        self.adopt_legacy()
        with self.db.read() as s:
            q = select(Migration).where(
                Migration.phase.in_(MigrationPhase.OPEN), Migration.host == self.host
            )
            return list(s.scalars(q.order_by(Migration.id)))

    def adopt_legacy(self) -> int:
        """Make this host the owner of every open intent that names no host; returns how many.

        One UPDATE whose condition is re-checked on each row after its lock is free (READ
        COMMITTED), so of two hosts starting at once each such intent goes to exactly one.
        On SQLite, where one tierd ever writes the catalog (its lock), every open intent is
        this host's, whatever host it names: a host id that changed (a recreated container's
        new hostname) must not leave a crashed move unrecovered.
        """
        mine: ColumnElement[bool] = Migration.host.is_(None)
        if self.db.single_writer:
            mine = or_(mine, Migration.host != self.host)
        q = (
            update(Migration)
            .where(mine, Migration.phase.in_(MigrationPhase.OPEN))
            .values(host=self.host)
        )
        return self.db.transact(
            lambda s: int(s.execute(q).rowcount or 0),  # type: ignore[attr-defined]
            changes_files=False,
        )

    def failed_temp_names(self) -> set[str]:
        """Temp names of failed intents: kept as evidence, never cleaned as orphans."""
        with self.db.read() as s:
            q = select(Migration.temp_name).where(Migration.phase == MigrationPhase.FAILED)
            return set(s.scalars(q))

    def kept_temp_names(self) -> set[str]:
        """Temp names no orphan cleanup may remove: failed intents' (evidence) and open ones'.

        After this host's recovery every open intent is another host's, whose move may be
        writing its temp right now on a tier the hosts share (a bucket), or whose own recovery
        must find it there.
        """
        with self.db.read() as s:
            q = select(Migration.temp_name).where(
                or_(
                    Migration.phase == MigrationPhase.FAILED,
                    Migration.phase.in_(MigrationPhase.OPEN),
                )
            )
            return set(s.scalars(q))

    def phase_counts(self) -> dict[str, int]:
        """Migrations by phase (``done``, ``aborted``, ``failed``, in flight...), for metrics."""
        q = select(Migration.phase, func.count()).group_by(Migration.phase)
        with self.db.read() as s:
            return {str(phase): int(n) for phase, n in s.execute(q)}

    def list(
        self,
        *,
        phases: Sequence[str] | None = None,
        file_id: int | None = None,
        before_id: int | None = None,
        limit: int = 100,
    ) -> list[Migration]:
        """Newest first, starting before ``before_id`` (keyset pagination)."""
        q = select(Migration)
        if phases is not None:
            q = q.where(Migration.phase.in_(list(phases)))
        if file_id is not None:
            q = q.where(Migration.file_id == file_id)
        if before_id is not None:
            q = q.where(Migration.id < before_id)
        with self.db.read() as s:
            return list(s.scalars(q.order_by(Migration.id.desc()).limit(limit)))
