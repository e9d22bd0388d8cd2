"""The migration protocol of RELIABILITY.md: the steps of one claimed move, tier A to tier B.

The step names are the test hook's steps (:data:`STEPS`)::

    claim            intent row (phase copying) + file -> migrating, one transaction, CAS
    source_opened    source opened (beneath A's root, O_NOFOLLOW; or HEAD of the object and its
                     ETag checked against the catalog's), stat recorded, space checked
    temp_created     B's writer made: .<file_id>.<intent_id>.tierd-tmp created O_EXCL in B's
                     final directory, or a multipart upload started at B's key
    copying          (after the first chunk) copy and hash in one streaming pass
    copied
    fsynced          temp fsynced, or every part uploaded (a failed sync is never retried)
    verified         hash == catalog checksum; the source is still the file that was opened
    published        link(temp, final) + fsync of B's directory (no clobber); or the multipart
                     upload completed with If-None-Match and verified by HEAD
    switched         the commit point: tier=B, stable, generation+1, intent switched (CAS)
    source_unlinked  source removed (only if it is still the version that was copied)
    source_removed   A's directory fsynced
    done             intent done

Every step goes through the tier interface (:class:`~tiering.tiers.Tier`), so the same protocol
moves between directories and object stores in either direction.

The claim (step 1) is :meth:`tiering.moves.Mover.claim`; :class:`MoveRunner` runs the rest.
Before ``switched`` the source is authoritative and every failure removes what the move made
at B. After it, B is. :mod:`tiering.moves.recovery` applies the same rule to intents a crash
left open.

File operations are called as ``os.<name>`` at call time (in the directory backend), so tests
inject faults by patching ``os`` functions;
:attr:`MoveSettings.hook` (``Mover.hook``) is called with each step's name (tests SIGKILL there).
"""

from __future__ import annotations

import logging
import threading
import time

from tiering.catalog import Catalog, FileRecord, FileState, Migration, MigrationPhase
from tiering.catalog.journal import Journal
from tiering.codec import CorruptContainer
from tiering.errors import (
    AlreadyExists,
    FileBusy,
    FileChanged,
    FileNotFound,
    InsufficientSpace,
    IntegrityError,
    InvalidPath,
    TierdError,
    Unavailable,
)
from tiering.integrity import DAMAGED
from tiering.moves.concurrency import (
    Claim,
    Progress,
    ProgressBoard,
    RateLimiter,
    ServingGate,
)
from tiering.moves.copying import CHUNK, COPY_NICE, Copier, MoveSettings, Pace
from tiering.moves.failures import (
    Abort,
    public_error,
    record_abort,
    retry_busy,
)
from tiering.tiers import Published, Source, Stat, Tier, Tiers, Writer

__all__ = ["CHUNK", "COPY_NICE", "STEPS", "MoveRunner", "MoveSettings"]

log = logging.getLogger(__name__)

STEPS = (
    "claimed",
    "source_opened",
    "temp_created",
    "copying",
    "copied",
    "fsynced",
    "verified",
    "published",
    "switched",
    "source_unlinked",
    "source_removed",
    "done",
)


class MoveRunner:
    """Runs steps 2-10 of claimed moves; all per-move state lives in one :meth:`run` call.

    Parameters
    ----------
    catalog, journal, tiers:
        The engine's catalog, migration journal and tiers.
    limiter:
        The bandwidth cap shared by all migrations.
    gate:
        Where moves yield to serving (see :class:`ServingGate`).
    board:
        Where each running move posts its bytes copied.
    settings:
        Shared with the :class:`~tiering.moves.Mover` (see :class:`MoveSettings`).
    """

    def __init__(
        self,
        catalog: Catalog,
        journal: Journal,
        tiers: Tiers,
        *,
        limiter: RateLimiter,
        gate: ServingGate,
        board: ProgressBoard,
        settings: MoveSettings,
    ) -> None:
        self.catalog = catalog
        self.journal = journal
        self.tiers = tiers
        self.limiter = limiter
        self.gate = gate
        self.board = board
        self.settings = settings
        self.copier = Copier(settings, board, limiter)

    def run(
        self, claim: Claim, progress: Progress | None, cancel: threading.Event | None
    ) -> Migration:
        """Steps 2-10 of ``claim``; on failure the abort is recorded and the public error raised.

        The caller releases the claim (guard, progress, ``done``) whatever happens.
        """
        intent, rec = claim.intent, claim.record
        src, dst = self.tiers.get(intent.src_tier), self.tiers.get(intent.dst_tier)
        pace = Pace(self.gate, cancel)
        writer: Writer | None = None
        published: Published | None = None
        source: Source | None = None
        try:
            try:
                source = self._open_source(src, rec)  # 2.
                st0 = source.stat
                room = self._room(dst, rec, st0.size)
                writer = self._open_temp(dst, claim, room)  # 3.
                checksum = self._write(claim, src, source, writer, progress, pace)  # 4.-6.
                published = self._publish(dst, rec, writer)  # 7.
            finally:
                if source is not None:
                    source.close()
                if writer is not None:
                    writer.abort()
            # -- 8. switch: the commit point -------------------------------------------------
            committed = self._switch(claim, checksum, published)
            if not committed:
                raise Abort(
                    FileBusy(f"file {rec.id} changed during the move; the move was dropped")
                )
        except BaseException as exc:
            record_abort(
                self.journal, intent, exc, dst, published, copied=self.board.get(intent.id)
            )
            public = public_error(exc)
            if public is exc:
                raise
            raise public from (None if isinstance(exc, Abort) else exc)
        self.settings.at("switched")
        return self._finish(claim, src, st0, pace)  # 9.-10.

    # -- the steps -----------------------------------------------------------------------------
    def _open_source(self, src: Tier, rec: FileRecord) -> Source:
        """2. Open the source and check it is the file the catalog recorded."""
        try:
            source = src.open(rec.relpath, etag=rec.etag)
        except CorruptContainer as exc:
            raise _damaged(src, rec, exc) from exc
        except (FileNotFound, InvalidPath) as exc:
            raise Abort(
                FileNotFound(f"{rec.relpath!r} vanished from tier {src.name}: {exc}"),
                FileState.MISSING,
            ) from exc
        except FileChanged as exc:
            raise Abort(
                IntegrityError(
                    f"{rec.relpath!r} on tier {src.name} changed since it was cataloged "
                    f"({exc.message}); a scan will pick up the new content"
                ),
                FileState.QUARANTINED,
            ) from exc
        st0 = source.stat
        if st0.size != rec.size or st0.mtime_ns != rec.mtime_ns:
            source.close()
            raise Abort(
                IntegrityError(
                    f"{rec.relpath!r} on tier {src.name} changed since it was cataloged "
                    "(size or mtime differ); a scan will pick up the new content"
                ),
                FileState.QUARANTINED,
            )
        self.settings.at("source_opened")
        return source

    def _room(self, dst: Tier, rec: FileRecord, size: int) -> int:
        """2. The destination's room, which must hold the file."""
        room = self.settings.room(dst)
        if size > room:
            raise InsufficientSpace(
                f"tier {dst.name} has room for {room} bytes; {rec.relpath!r} needs {size}",
                tier=dst.name,
                free=room,
            )
        return room

    def _open_temp(self, dst: Tier, claim: Claim, room: int) -> Writer:
        """3. A temp file in the destination's final directory."""
        rec = claim.record
        try:
            writer = dst.writer(
                rec.relpath,
                limit=room,
                temp_stem=temp_stem(claim.intent.temp_name),
                checksum=rec.checksum,
            )
        except AlreadyExists as exc:
            raise Abort(
                AlreadyExists(
                    f"another file already exists at {rec.relpath!r} on tier {dst.name}; "
                    "nothing was overwritten, the file is quarantined until a person "
                    "decides",
                    path=rec.relpath,
                ),
                FileState.QUARANTINED,
                MigrationPhase.FAILED,
            ) from exc
        self.settings.at("temp_created")
        return writer

    def _write(
        self,
        claim: Claim,
        src: Tier,
        source: Source,
        writer: Writer,
        progress: Progress | None,
        pace: Pace,
    ) -> str:
        """4. Copy and hash in one pass; 5. sync (with the source's mode and times, so scan
        sees it unchanged); 6. verify. Returns the copy's checksum."""
        rec, st0 = claim.record, source.stat
        try:
            copied = self.copier.copy(claim, source, writer, st0.size, progress, pace)
        except CorruptContainer as exc:
            raise _damaged(src, rec, exc) from exc
        self.settings.at("copied")
        writer.sync(mode=st0.mode, times_ns=(st0.atime_ns or st0.mtime_ns, st0.mtime_ns))
        self.settings.at("fsynced")
        checksum = writer.checksum
        self._verify_source(src, rec, source, copied)
        if rec.checksum is not None and checksum != rec.checksum:
            raise Abort(
                IntegrityError(
                    f"{rec.relpath!r} on tier {src.name} does not match its catalog "
                    f"checksum ({checksum} != {rec.checksum}); left alone and flagged"
                ),
                FileState.QUARANTINED,
                MigrationPhase.FAILED,
            )
        self.settings.at("verified")
        return checksum

    def _publish(self, dst: Tier, rec: FileRecord, writer: Writer) -> Published:
        """7. Publish without clobbering; fsync the directory."""
        try:
            published = writer.publish()
        except AlreadyExists as exc:
            raise Abort(
                AlreadyExists(
                    f"a file appeared at {rec.relpath!r} on tier {dst.name} during the "
                    "move; nothing was overwritten, the file is quarantined",
                    path=rec.relpath,
                ),
                FileState.QUARANTINED,
                MigrationPhase.FAILED,
            ) from exc
        except BaseException:
            # A failure after link() (the directory fsync) leaves the final name;
            # remove it if it is our file.
            synced = writer.synced
            if synced is not None:
                dst.remove(rec.relpath, version=synced.version)
            raise
        self.settings.at("published")
        return published

    def _finish(self, claim: Claim, src: Tier, st0: Stat, pace: Pace) -> Migration:
        """9. Remove the source (the destination is authoritative now); 10. done."""
        intent, rec = claim.intent, claim.record
        try:
            self._remove_source(src, rec.relpath, st0)
        except (OSError, TierdError) as exc:
            # The move is committed; recovery at the next start finishes the unlink.
            log.error(
                "migration %d: could not remove the source on %s: %s", intent.id, src.name, exc
            )
            return self.journal.get(intent.id) or intent
        finished = retry_busy(lambda: self.journal.finish(intent.id))
        self.settings.at("done")
        # The steps since the last chunk rest too, once the file's guard is let go (the mover
        # rests after its run): a rest holding it kept the file busy, and a planner pass then
        # skipped it (a pin's move waited for the next periodic pass).
        claim.owed_rest_s = time.monotonic() - pace.since
        return finished or intent

    def _verify_source(self, src: Tier, rec: FileRecord, source: Source, copied: int) -> None:
        if not (copied == source.stat.size and source.unchanged()):
            raise Abort(
                FileBusy(
                    f"{rec.relpath!r} on tier {src.name} was changed, replaced or removed during "
                    "the move; the source was left alone and the file flagged for a scan"
                ),
                FileState.QUARANTINED,
            )

    def _switch(self, claim: Claim, checksum: str, published: Published | None) -> bool:
        intent = claim.intent
        assert published is not None  # the copy was published before the commit point
        try:
            return self.journal.switch(
                intent,
                checksum=checksum,
                size=published.size,
                mtime_ns=published.mtime_ns,
                etag=published.etag,
                codec=published.stat.codec,
                stored_size=published.stat.stored_size,
            ).committed
        except BaseException:
            # The commit may or may not have happened: look before deleting anything.
            try:
                rec = self.catalog.get(claim.record.id)
            except (TierdError, OSError):
                log.error("migration %d: switch outcome unknown; recovery will decide", intent.id)
                raise Abort(
                    Unavailable("the catalog failed at the commit point; recovery will decide"),
                    phase="unknown",
                ) from None
            if rec.tier == intent.dst_tier and rec.generation == intent.generation + 1:
                return True
            raise

    def _remove_source(self, src: Tier, relpath: str, st0: Stat) -> None:
        if src.remove(
            relpath, version=st0.version, between=lambda: self.settings.at("source_unlinked")
        ):
            self.settings.at("source_removed")


def temp_stem(temp_name: str) -> str:
    """The stem of an intent's temp name (``.<stem>.tierd-tmp``), which names its writer."""
    return temp_name.removeprefix(".").removesuffix(".tierd-tmp")


def _damaged(src: Tier, rec: FileRecord, exc: CorruptContainer) -> Abort:
    """The source's stored bytes fail their check: damage, not a change. The file is
    quarantined with the reason (``damaged: ...``, see :mod:`tiering.integrity`), the move
    fails, and nothing is retried until a person uploads it again or deletes it."""
    return Abort(
        IntegrityError(f"{DAMAGED}{exc.message} (on tier {src.name}; left alone)"),
        FileState.QUARANTINED,
        MigrationPhase.FAILED,
    )
