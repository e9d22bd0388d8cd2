"""The migration protocol of RELIABILITY.md: the steps of one claimed move, tier A to tier B.

The step names are the test hook's steps (:data:`STEPS`)::

    claim            intent row (phase copying) + file -> migrating, one transaction, CAS
    source_opened    source opened O_NOFOLLOW beneath A's root, fstat recorded, space checked
    temp_created     .<file_id>.<intent_id>.tierd-tmp created O_EXCL in B's final directory
    copying          (after the first chunk) copy and hash in one streaming pass
    copied
    fsynced          temp fsynced (a failed fsync discards the temp; it is never retried)
    verified         hash == catalog checksum; source re-stat (fd and path): same identity
    published        link(temp, final) (no clobber), unlink temp, fsync B's directory
    switched         the commit point: tier=B, stable, generation+1, intent switched (CAS)
    source_unlinked  source unlinked (only if it is still the inode that was copied)
    source_removed   A's directory fsynced
    done             intent done

The claim (step 1) is :meth:`tiering.moves.Mover.claim`; :class:`MoveRunner` runs the rest.
Before ``switched`` the source is authoritative and every failure removes what the move made
at B. After it, B is. :mod:`tiering.moves.recovery` applies the same rule to intents a crash
left open.

File operations are called as ``os.<name>`` at call time (here and in
:mod:`tiering.moves.fsops`), so tests inject faults by patching ``os`` functions;
:attr:`MoveSettings.hook` (``Mover.hook``) is called with each step's name (tests SIGKILL there).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

from tiering.catalog import Catalog, FileRecord, FileState, Migration, MigrationPhase
from tiering.catalog.journal import Journal
from tiering.errors import (
    AlreadyExists,
    FileBusy,
    FileNotFound,
    InsufficientSpace,
    IntegrityError,
    InvalidPath,
    TierdError,
    Unavailable,
)
from tiering.moves.concurrency import Claim, Progress, ProgressBoard, RateLimiter
from tiering.moves.failures import (
    Abort,
    Cancelled,
    public_error,
    record_abort,
    retry_busy,
    storage_error,
)
from tiering.moves.fsops import (
    AtomicWriter,
    Published,
    identity,
    lstat_file,
    unlink_if_same,
)
from tiering.tiers import Tier, Tiers

__all__ = ["CHUNK", "STEPS", "MoveRunner", "MoveSettings"]

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
CHUNK = 4 << 20


@dataclass
class MoveSettings:
    """The knobs a move reads while it runs.

    One instance is shared by the :class:`~tiering.moves.Mover` (whose ``room``, ``chunk_size``
    and ``hook`` are views of it) and its :class:`MoveRunner`, so a knob is read at the step
    that uses it, never copied when a move starts.
    """

    room: Callable[[Tier], int]
    chunk_size: int = CHUNK
    #: Test-only: called with each step's name (see STEPS).
    hook: Callable[[str], None] | None = None

    def at(self, step: str) -> None:
        """A move reached ``step``: tell the hook, if any."""
        if self.hook is not None:
            self.hook(step)


class MoveRunner:
    """Runs steps 2-10 of claimed moves; all per-move state lives in one :meth:`run` call.

    Parameters
    ----------
    catalog, journal, tiers:
        The engine's catalog, migration journal and tiers.
    limiter:
        The bandwidth cap shared by all migrations.
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
        board: ProgressBoard,
        settings: MoveSettings,
    ) -> None:
        self.catalog = catalog
        self.journal = journal
        self.tiers = tiers
        self.limiter = limiter
        self.board = board
        self.settings = settings

    def run(
        self, claim: Claim, progress: Progress | None, cancel: threading.Event | None
    ) -> Migration:
        """Steps 2-10 of ``claim``; on failure the abort is recorded and the public error raised.

        The caller releases the claim (guard, progress, ``done``) whatever happens.
        """
        intent, rec = claim.intent, claim.record
        src, dst = self.tiers.get(intent.src_tier), self.tiers.get(intent.dst_tier)
        writer: AtomicWriter | None = None
        published: Published | None = None
        src_fd = -1
        copied = 0
        try:
            try:
                # -- 2. open the source, record its identity, check space ----------------------
                try:
                    src_fd, st0 = src.open_read(rec.relpath)
                except (FileNotFound, InvalidPath) as exc:
                    raise Abort(
                        FileNotFound(f"{rec.relpath!r} vanished from tier {src.name}: {exc}"),
                        FileState.MISSING,
                    ) from exc
                if st0.st_size != rec.size or st0.st_mtime_ns != rec.mtime_ns:
                    raise Abort(
                        IntegrityError(
                            f"{rec.relpath!r} on tier {src.name} changed since it was cataloged "
                            "(size or mtime differ); a scan will pick up the new content"
                        ),
                        FileState.QUARANTINED,
                    )
                self.settings.at("source_opened")
                room = self.settings.room(dst)
                if st0.st_size > room:
                    raise InsufficientSpace(
                        f"tier {dst.name} has room for {room} bytes; {rec.relpath!r} needs "
                        f"{st0.st_size}",
                        tier=dst.name,
                        free=room,
                    )
                # -- 3. temp file in the destination's final directory -------------------------
                try:
                    writer = AtomicWriter(
                        dst,
                        rec.relpath,
                        limit=room,
                        temp_stem=intent.temp_name.removeprefix(".").removesuffix(".tierd-tmp"),
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
                # -- 4. copy and hash in one pass ----------------------------------------------
                copied = self._copy(claim, src_fd, writer, st0.st_size, progress, cancel)
                self.settings.at("copied")
                # -- 5. fsync (with the source's mode and times, so scan sees it unchanged) ---
                writer.sync(
                    mode=stat.S_IMODE(st0.st_mode), times_ns=(st0.st_atime_ns, st0.st_mtime_ns)
                )
                self.settings.at("fsynced")
                # -- 6. verify -----------------------------------------------------------------
                checksum = writer.checksum
                self._verify_source(src, rec, src_fd, st0, copied)
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
                # -- 7. publish without clobbering; fsync the directory ------------------------
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
                    # remove it if it is our inode.
                    synced = writer.synced
                    if synced is not None:
                        unlink_if_same(dst, rec.relpath, synced)
                    raise
                self.settings.at("published")
            finally:
                if src_fd >= 0:
                    os.close(src_fd)
                if writer is not None:
                    writer.abort()
            # -- 8. switch: the commit point -------------------------------------------------
            committed = self._switch(claim, checksum, copied, st0.st_mtime_ns)
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
        # -- 9. remove the source (B is authoritative now) -----------------------------------
        try:
            self._remove_source(src, rec.relpath, st0)
        except (OSError, TierdError) as exc:
            # The move is committed; recovery at the next start finishes the unlink.
            log.error(
                "migration %d: could not remove the source on %s: %s", intent.id, src.name, exc
            )
            return self.journal.get(intent.id) or intent
        # -- 10. done --------------------------------------------------------------------------
        retry_busy(lambda: self.journal.finish(intent.id))
        self.settings.at("done")
        return self.journal.get(intent.id) or intent

    def _copy(
        self,
        claim: Claim,
        src_fd: int,
        writer: AtomicWriter,
        size: int,
        progress: Progress | None,
        cancel: threading.Event | None,
    ) -> int:
        with suppress(OSError):
            os.posix_fadvise(src_fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buf = bytearray(self.settings.chunk_size)
        view = memoryview(buf)
        off = 0
        iid = claim.intent.id
        first = True
        while True:
            if cancel is not None and cancel.is_set():
                raise Cancelled("the engine is stopping; the move was abandoned")
            try:
                n = os.preadv(src_fd, [view], off)
            except OSError as exc:
                raise storage_error(exc, f"reading {claim.record.relpath!r}") from exc
            if n == 0:
                break
            try:
                writer.write(view[:n])
            except OSError as exc:
                raise storage_error(exc, f"writing to tier {writer.tier.name}") from exc
            off += n
            self.board.set(iid, off)
            if progress is not None:
                progress(off, size)
            if first:
                first = False
                self.settings.at("copying")
            self.limiter.acquire(n, cancel)
        return off

    def _verify_source(
        self, src: Tier, rec: FileRecord, fd: int, st0: os.stat_result, copied: int
    ) -> None:
        st_fd = os.fstat(fd)
        st_path = lstat_file(src, rec.relpath)
        same = (
            copied == st0.st_size
            and identity(st_fd) == identity(st0)
            and st_path is not None
            and identity(st_path) == identity(st0)
        )
        if not same:
            raise Abort(
                FileBusy(
                    f"{rec.relpath!r} on tier {src.name} was changed, replaced or removed during "
                    "the move; the source was left alone and the file flagged for a scan"
                ),
                FileState.QUARANTINED,
            )

    def _switch(self, claim: Claim, checksum: str, size: int, mtime_ns: int) -> bool:
        intent = claim.intent
        try:
            return self.journal.switch(
                intent, checksum=checksum, size=size, mtime_ns=mtime_ns
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

    def _remove_source(self, src: Tier, relpath: str, st0: os.stat_result) -> None:
        if unlink_if_same(src, relpath, st0, lambda: self.settings.at("source_unlinked")):
            self.settings.at("source_removed")
