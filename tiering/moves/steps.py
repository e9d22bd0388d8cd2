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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from tiering.catalog import Catalog, FileRecord, FileState, Migration, MigrationPhase
from tiering.catalog.journal import Journal
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
from tiering.moves.concurrency import (
    Claim,
    Progress,
    ProgressBoard,
    RateLimiter,
    ServingGate,
    lower_priority,
)
from tiering.moves.failures import (
    Abort,
    Cancelled,
    public_error,
    record_abort,
    retry_busy,
    storage_error,
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
CHUNK = 4 << 20
#: How many nice levels below the process the thread that copies a move's bytes runs.
COPY_NICE = 10
_POLL_S = (0.001, 0.016)  # a move looks whether its copy has finished: first, then at most


@dataclass
class MoveSettings:
    """The knobs a move reads while it runs.

    One instance is shared by the :class:`~tiering.moves.Mover` (whose ``room``, ``chunk_size``
    and ``hook`` are views of it) and its :class:`MoveRunner`, so a knob is read at the step
    that uses it, never copied when a move starts.
    """

    room: Callable[[Tier], int]
    chunk_size: int = CHUNK
    #: Nice levels (Linux) below the process for the thread that copies and hashes; 0 copies
    #: in the move's own thread, at its priority.
    copy_nice: int = COPY_NICE
    #: Test-only: called with each step's name (see STEPS).
    hook: Callable[[str], None] | None = None

    def at(self, step: str) -> None:
        """A move reached ``step``: tell the hook, if any."""
        if self.hook is not None:
            self.hook(step)


@dataclass
class _Pace:
    """A move's work since it last rested, for :class:`ServingGate`: the move rests after each
    chunk it copies, and once at its end for its other steps (open, sync, publish, switch,
    unlink), so every step of it yields to serving, not the copy alone."""

    gate: ServingGate
    cancel: threading.Event | None
    since: float = field(default_factory=time.monotonic)

    def rest(self) -> None:
        """Rest (while serving is busy) for the work done since the last rest."""
        self.gate.rest(time.monotonic() - self.since, self.cancel)
        self.since = time.monotonic()

    def restart(self) -> None:
        """What passed since the last rest was no work (a wait for the bandwidth cap)."""
        self.since = time.monotonic()


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

    def run(
        self, claim: Claim, progress: Progress | None, cancel: threading.Event | None
    ) -> Migration:
        """Steps 2-10 of ``claim``; on failure the abort is recorded and the public error raised.

        The caller releases the claim (guard, progress, ``done``) whatever happens.
        """
        intent, rec = claim.intent, claim.record
        src, dst = self.tiers.get(intent.src_tier), self.tiers.get(intent.dst_tier)
        pace = _Pace(self.gate, cancel)
        writer: Writer | None = None
        published: Published | None = None
        source: Source | None = None
        copied = 0
        try:
            try:
                # -- 2. open the source, record its identity, check space ----------------------
                try:
                    source = src.open(rec.relpath, etag=rec.etag)
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
                    raise Abort(
                        IntegrityError(
                            f"{rec.relpath!r} on tier {src.name} changed since it was cataloged "
                            "(size or mtime differ); a scan will pick up the new content"
                        ),
                        FileState.QUARANTINED,
                    )
                self.settings.at("source_opened")
                room = self.settings.room(dst)
                if st0.size > room:
                    raise InsufficientSpace(
                        f"tier {dst.name} has room for {room} bytes; {rec.relpath!r} needs "
                        f"{st0.size}",
                        tier=dst.name,
                        free=room,
                    )
                # -- 3. temp file in the destination's final directory -------------------------
                try:
                    writer = dst.writer(
                        rec.relpath,
                        limit=room,
                        temp_stem=temp_stem(intent.temp_name),
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
                # -- 4. copy and hash in one pass ----------------------------------------------
                copied = self._copy(claim, source, writer, st0.size, progress, pace)
                self.settings.at("copied")
                # -- 5. sync (with the source's mode and times, so scan sees it unchanged) ----
                writer.sync(mode=st0.mode, times_ns=(st0.atime_ns or st0.mtime_ns, st0.mtime_ns))
                self.settings.at("fsynced")
                # -- 6. verify -----------------------------------------------------------------
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
                    # remove it if it is our file.
                    synced = writer.synced
                    if synced is not None:
                        dst.remove(rec.relpath, version=synced.version)
                    raise
                self.settings.at("published")
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
        # The steps since the last chunk rest too, once the file's guard is let go (the mover
        # rests after its run): a rest holding it kept the file busy, and a planner pass then
        # skipped it (a pin's move waited for the next periodic pass).
        claim.owed_rest_s = time.monotonic() - pace.since
        return self.journal.get(intent.id) or intent

    def _copy(
        self,
        claim: Claim,
        source: Source,
        writer: Writer,
        size: int,
        progress: Progress | None,
        pace: _Pace,
    ) -> int:
        """Step 4: copy and hash, on a thread of its own at ``copy_nice`` below the process.

        The copy is a move's CPU work (page-cache copies and the hash), and on a busy host it
        competes with serving for the cores (``tierd bench serving``): at a lower priority it
        takes what serving leaves. Only the copy loop, which holds the GIL for microseconds
        between system calls: a low-priority thread that loses its core while holding the
        GIL stalls every thread of the process until it runs again, so the work that holds
        the GIL longer or makes system calls under it stays here, at the move's priority: the
        catalog steps, and the first read (which allocates the chunk buffer) and the last
        close (which frees it). The copy thread is started and ended here, so it never
        outlives the move.
        """
        nice = self.settings.copy_nice
        cancel = pace.cancel
        chunks = source.chunks(self.settings.chunk_size)
        try:
            if nice <= 0 or size <= self.settings.chunk_size:
                # One chunk costs less CPU than a thread and its start: copied here.
                return self._copy_loop(claim, chunks, writer, size, progress, pace, None)
            first = self._next(claim, chunks, cancel, None)
            stop = threading.Event()  # set when the waiting thread is interrupted
            done: list[int] = []
            failed: list[BaseException] = []
            lowered = threading.Event()  # the copy starts only once its priority is set

            def work() -> None:
                lowered.wait()
                try:
                    done.append(
                        self._copy_loop(claim, chunks, writer, size, progress, pace, stop, first)
                    )
                except BaseException as exc:  # re-raised in the move's thread below
                    failed.append(exc)

            thread = threading.Thread(
                target=work, name=f"tierd-copy-{claim.intent.id}", daemon=True
            )
            thread.start()
            # From here, which holds the GIL, so the copy thread does not (see lower_priority).
            try:
                lower_priority(thread.native_id, nice)
            finally:
                lowered.set()
            try:
                # Polled, not joined: a thread blocked in join() is woken by the copy thread's
                # exit while that thread still holds the GIL, and the kernel may then preempt
                # the low-priority thread there, GIL and all. Polled, it exits waking no one.
                poll = _POLL_S[0]
                while thread.is_alive():
                    time.sleep(poll)
                    poll = min(2 * poll, _POLL_S[1])
            except BaseException:
                # The source and writer are closed after this returns: the copy must stop.
                stop.set()
                thread.join()
                raise
            thread.join()
            if failed:
                raise failed[0]
            return done[0]
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()  # stops a read-ahead source's GETs now, not at garbage collection

    def _next(
        self,
        claim: Claim,
        chunks: Iterator[memoryview],
        cancel: threading.Event | None,
        stop: threading.Event | None,
    ) -> memoryview | None:
        """The next chunk of the source, or None at its end; stops a move asked to stop."""
        if cancel is not None and cancel.is_set():
            raise Cancelled("the engine is stopping; the move was abandoned")
        if stop is not None and stop.is_set():
            raise Cancelled("the move was interrupted")
        try:
            return next(chunks, None)
        except OSError as exc:
            raise storage_error(exc, f"reading {claim.record.relpath!r}") from exc

    def _copy_loop(
        self,
        claim: Claim,
        chunks: Iterator[memoryview],
        writer: Writer,
        size: int,
        progress: Progress | None,
        pace: _Pace,
        stop: threading.Event | None,
        first: memoryview | None | Literal[False] = False,
    ) -> int:
        """Write and hash ``chunks`` (after ``first``, when the caller already read it); after
        each chunk, rest while serving is busy (see :class:`ServingGate`)."""
        off = 0
        iid = claim.intent.id
        cancel = pace.cancel
        chunk = self._next(claim, chunks, cancel, stop) if first is False else first
        while chunk is not None:
            n = len(chunk)
            try:
                writer.write(chunk)
            except OSError as exc:
                raise storage_error(exc, f"writing to tier {writer.tier.name}") from exc
            off += n
            self.board.set(iid, off)
            if progress is not None:
                progress(off, size)
            if off == n:
                self.settings.at("copying")
            pace.rest()
            self.limiter.acquire(n, cancel)
            pace.restart()
            chunk = self._next(claim, chunks, cancel, stop)
        return off

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
