"""The migration protocol of RELIABILITY.md, and crash recovery.

One move of one file from tier A to tier B, step by step (the names are the test hook's steps)::

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

Before ``switched`` the source is authoritative and every failure removes what the move made
at B. After it, B is. :meth:`Mover.recover` applies the same rule to intents a crash left open.

File operations are called as ``os.<name>`` at call time, so tests inject faults by patching
``os`` functions; :attr:`Mover.hook` is called with each step's name (tests SIGKILL there).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

from tiering.catalog import Catalog, FileRecord, FileState, Migration, MigrationPhase
from tiering.catalog.journal import Journal
from tiering.checksum import hash_fd
from tiering.errors import (
    AlreadyExists,
    CatalogBusy,
    FileBusy,
    FileNotFound,
    InsufficientSpace,
    IntegrityError,
    InvalidPath,
    TierdError,
    TierNotFound,
    Unavailable,
)
from tiering.moves.fsops import AtomicWriter, Published
from tiering.tiers import Tier, Tiers
from tiering.tiers.paths import split_relpath

__all__ = [
    "STEPS",
    "Claim",
    "FileGuards",
    "Mover",
    "RateLimiter",
    "RecoveryReport",
]

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
Progress = Callable[[int, int], None]


class Cancelled(Unavailable):
    """The move was abandoned because the engine is stopping."""

    code = "cancelled"


class FileGuards:
    """In-process exclusion per file id between the mover, uploads and deletes.

    The catalog's compare-and-set serialises changes durably; the guard keeps a publish or a
    delete from landing between a move's switch and its source unlink, where the CAS alone would
    let the mover unlink bytes that just arrived. Holding is never blocking: a busy file is
    :class:`FileBusy` (409) at once.
    """

    def __init__(self) -> None:
        self._held: set[int] = set()
        self._lock = threading.Lock()

    def acquire(self, file_id: int) -> None:
        with self._lock:
            if file_id in self._held:
                raise FileBusy(f"file {file_id} is being migrated; try again", file_id=file_id)
            self._held.add(file_id)

    def release(self, file_id: int) -> None:
        with self._lock:
            self._held.discard(file_id)

    @contextmanager
    def hold(self, file_id: int) -> Iterator[None]:
        self.acquire(file_id)
        try:
            yield
        finally:
            self.release(file_id)

    def __contains__(self, file_id: object) -> bool:
        with self._lock:
            return file_id in self._held


class RateLimiter:
    """A byte-rate cap shared by every migration (None: no cap); waits are interruptible."""

    BURST_S = 0.05

    def __init__(self, bytes_per_s: float | None = None) -> None:
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def set_rate(self, bytes_per_s: float | None) -> None:
        with self._lock:
            self.rate = bytes_per_s
            self._next = time.monotonic()

    def acquire(self, n: int, cancel: threading.Event | None = None) -> None:
        with self._lock:
            if not self.rate:
                return
            now = time.monotonic()
            # A virtual clock: each caller books its bytes' share of time after the last one.
            self._next = max(self._next, now - self.BURST_S) + n / self.rate
            delay = self._next - now - self.BURST_S
        if delay > 0:
            if cancel is not None:
                cancel.wait(delay)
            else:
                time.sleep(delay)


@dataclass
class Claim:
    """A claimed move: the intent is written, the file is ``migrating`` and guarded."""

    intent: Migration
    record: FileRecord
    done: threading.Event = field(default_factory=threading.Event)
    result: Migration | None = None
    error: BaseException | None = None


@dataclass
class RecoveryReport:
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


class _Abort(Exception):
    """Internal: stop the move, give the file ``state`` and close the intent as ``phase``."""

    def __init__(
        self, error: TierdError, state: str = FileState.STABLE, phase: str = MigrationPhase.ABORTED
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.state = state
        self.phase = phase


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _storage_error(exc: OSError, where: str) -> TierdError:
    from tiering.errors import StorageError

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientSpace(f"{where}: out of space ({exc.strerror})")
    return StorageError(f"{where}: {exc.strerror or exc} (errno {exc.errno})", errno=exc.errno)


class Mover:
    """Runs migrations and recovers the ones a crash interrupted.

    Parameters
    ----------
    catalog, journal, tiers:
        The engine's catalog, migration journal and tiers.
    guards:
        Shared with uploads and deletes (see :class:`FileGuards`).
    limiter:
        The bandwidth cap shared by all migrations.
    room:
        Bytes that may still be placed on a tier (free space capped by its quota).
    chunk_size:
        Bytes per read/write of the copy.
    """

    def __init__(
        self,
        catalog: Catalog,
        journal: Journal,
        tiers: Tiers,
        *,
        guards: FileGuards | None = None,
        limiter: RateLimiter | None = None,
        room: Callable[[Tier], int] | None = None,
        chunk_size: int = CHUNK,
    ) -> None:
        self.catalog = catalog
        self.journal = journal
        self.tiers = tiers
        self.guards = guards or FileGuards()
        self.limiter = limiter or RateLimiter()
        self.room = room or (lambda tier: tier.space().free)
        self.chunk_size = chunk_size
        #: Test-only: called with each step's name (see STEPS).
        self.hook: Callable[[str], None] | None = None
        self._progress: dict[int, int] = {}
        self._progress_lock = threading.Lock()

    def _at(self, step: str) -> None:
        if self.hook is not None:
            self.hook(step)

    def progress(self) -> dict[int, int]:
        """Bytes copied so far per in-flight intent id."""
        with self._progress_lock:
            return dict(self._progress)

    # -- one move ----------------------------------------------------------------------------
    def claim(
        self,
        file_id: int,
        dst_tier: str,
        *,
        reason: str,
        expected_generation: int | None = None,
    ) -> Claim:
        """Step 1. Raises FileBusy, Conflict, FileNotFound or TierNotFound; nothing changes."""
        self.tiers.get(dst_tier)
        self.guards.acquire(file_id)
        try:
            intent, rec = self.journal.claim(
                file_id, dst_tier, reason=reason, expected_generation=expected_generation
            )
        except BaseException:
            self.guards.release(file_id)
            raise
        self._at("claimed")
        return Claim(intent, rec)

    def abandon(self, claim: Claim, why: str) -> None:
        """Release a claim that never started copying."""
        try:
            self.journal.release(claim.intent, phase=MigrationPhase.ABORTED, error=why)
        finally:
            self.guards.release(claim.record.id)
            claim.error = Cancelled(why)
            claim.done.set()

    def migrate(
        self,
        file_id: int,
        dst_tier: str,
        *,
        reason: str = "manual",
        expected_generation: int | None = None,
        progress: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> Migration:
        """Claim and run one move in this thread; returns the finished intent."""
        claim = self.claim(
            file_id, dst_tier, reason=reason, expected_generation=expected_generation
        )
        return self.run(claim, progress=progress, cancel=cancel)

    def run(
        self,
        claim: Claim,
        *,
        progress: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> Migration:
        """Steps 2-10 of a claimed move.

        Raises
        ------
        InsufficientSpace, AlreadyExists, IntegrityError, FileBusy, StorageError, Cancelled
            The move was aborted: the source is untouched and authoritative, nothing is left at
            the destination, and the intent records the error.
        """
        try:
            result = self._run(claim, progress, cancel)
        except BaseException as exc:
            claim.error = exc
            raise
        else:
            claim.result = result
            return result
        finally:
            with self._progress_lock:
                self._progress.pop(claim.intent.id, None)
            self.guards.release(claim.record.id)
            claim.done.set()

    def _run(
        self, claim: Claim, progress: Progress | None, cancel: threading.Event | None
    ) -> Migration:
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
                    raise _Abort(
                        FileNotFound(f"{rec.relpath!r} vanished from tier {src.name}: {exc}"),
                        FileState.MISSING,
                    ) from exc
                if st0.st_size != rec.size or st0.st_mtime_ns != rec.mtime_ns:
                    raise _Abort(
                        IntegrityError(
                            f"{rec.relpath!r} on tier {src.name} changed since it was cataloged "
                            "(size or mtime differ); a scan will pick up the new content"
                        ),
                        FileState.QUARANTINED,
                    )
                self._at("source_opened")
                room = self.room(dst)
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
                    raise _Abort(
                        AlreadyExists(
                            f"another file already exists at {rec.relpath!r} on tier {dst.name}; "
                            "nothing was overwritten, the file is quarantined until a person "
                            "decides",
                            path=rec.relpath,
                        ),
                        FileState.QUARANTINED,
                        MigrationPhase.FAILED,
                    ) from exc
                self._at("temp_created")
                # -- 4. copy and hash in one pass ----------------------------------------------
                copied = self._copy(claim, src_fd, writer, st0.st_size, progress, cancel)
                self._at("copied")
                # -- 5. fsync (with the source's mode and times, so scan sees it unchanged) ---
                writer.sync(
                    mode=stat.S_IMODE(st0.st_mode), times_ns=(st0.st_atime_ns, st0.st_mtime_ns)
                )
                self._at("fsynced")
                # -- 6. verify -----------------------------------------------------------------
                checksum = writer.checksum
                self._verify_source(src, rec, src_fd, st0, copied)
                if rec.checksum is not None and checksum != rec.checksum:
                    raise _Abort(
                        IntegrityError(
                            f"{rec.relpath!r} on tier {src.name} does not match its catalog "
                            f"checksum ({checksum} != {rec.checksum}); left alone and flagged"
                        ),
                        FileState.QUARANTINED,
                        MigrationPhase.FAILED,
                    )
                self._at("verified")
                # -- 7. publish without clobbering; fsync the directory ------------------------
                try:
                    published = writer.publish()
                except AlreadyExists as exc:
                    raise _Abort(
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
                    synced = writer._synced
                    if synced is not None:
                        self._unlink_if_same(dst, rec.relpath, synced)
                    raise
                self._at("published")
            finally:
                if src_fd >= 0:
                    os.close(src_fd)
                if writer is not None:
                    writer.abort()
            # -- 8. switch: the commit point -------------------------------------------------
            committed = self._switch(claim, checksum, copied, st0.st_mtime_ns)
            if not committed:
                raise _Abort(
                    FileBusy(f"file {rec.id} changed during the move; the move was dropped")
                )
        except BaseException as exc:
            self._abort(claim, exc, dst, published)
            public = self._public(exc)
            if public is exc:
                raise
            raise public from (None if isinstance(exc, _Abort) else exc)
        self._at("switched")
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
        self._retry(lambda: self.journal.finish(intent.id))
        self._at("done")
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
        buf = bytearray(self.chunk_size)
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
                raise _storage_error(exc, f"reading {claim.record.relpath!r}") from exc
            if n == 0:
                break
            try:
                writer.write(view[:n])
            except OSError as exc:
                raise _storage_error(exc, f"writing to tier {writer.tier.name}") from exc
            off += n
            with self._progress_lock:
                self._progress[iid] = off
            if progress is not None:
                progress(off, size)
            if first:
                first = False
                self._at("copying")
            self.limiter.acquire(n, cancel)
        return off

    def _verify_source(
        self, src: Tier, rec: FileRecord, fd: int, st0: os.stat_result, copied: int
    ) -> None:
        st_fd = os.fstat(fd)
        st_path = self._lstat(src, rec.relpath)
        same = (
            copied == st0.st_size
            and _identity(st_fd) == _identity(st0)
            and st_path is not None
            and _identity(st_path) == _identity(st0)
        )
        if not same:
            raise _Abort(
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
                raise _Abort(
                    Unavailable("the catalog failed at the commit point; recovery will decide"),
                    phase="unknown",
                ) from None
            if rec.tier == intent.dst_tier and rec.generation == intent.generation + 1:
                return True
            raise

    def _abort(
        self, claim: Claim, exc: BaseException, dst: Tier, published: Published | None
    ) -> None:
        intent = claim.intent
        if isinstance(exc, _Abort) and exc.phase == "unknown":
            return  # commit state uncertain: delete nothing, leave the intent to recovery
        if published is not None:
            self._unlink_published(dst, intent.relpath, published)
        err: BaseException
        if isinstance(exc, _Abort):
            state, phase, err = exc.state, exc.phase, exc.error
        else:
            state, phase = FileState.STABLE, MigrationPhase.ABORTED
            err = self._public(exc)
        text = err.message if isinstance(err, TierdError) else str(err)
        detail = text if state != FileState.STABLE else None
        message = f"{type(err).__name__}: {text}"
        copied = self.progress().get(intent.id)
        try:
            self._retry(
                lambda: self.journal.release(
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

    @staticmethod
    def _public(exc: BaseException) -> BaseException:
        if isinstance(exc, _Abort):
            return exc.error
        if isinstance(exc, OSError):
            return _storage_error(exc, "migration")
        return exc

    @staticmethod
    def _retry(fn: Callable[[], object], tries: int = 3) -> None:
        for i in range(tries):
            try:
                fn()
                return
            except CatalogBusy:
                if i == tries - 1:
                    raise
                time.sleep(0.1 * (i + 1))

    # -- filesystem helpers ------------------------------------------------------------------
    @staticmethod
    def _lstat(tier: Tier, relpath: str) -> os.stat_result | None:
        dirs, name = split_relpath(relpath)
        try:
            dfd = tier.open_dir(dirs)
        except OSError:
            return None
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        finally:
            os.close(dfd)
        return st if stat.S_ISREG(st.st_mode) else None

    def _unlink_if_same(
        self,
        tier: Tier,
        relpath: str,
        st: os.stat_result,
        between: Callable[[], None] | None = None,
    ) -> bool:
        """Unlink ``relpath`` and fsync its directory, only if it is the inode ``st``."""
        dirs, name = split_relpath(relpath)
        try:
            dfd = tier.open_dir(dirs)
        except OSError:
            return False
        try:
            try:
                cur = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if (cur.st_dev, cur.st_ino) != (st.st_dev, st.st_ino):
                log.warning(
                    "not removing %r on tier %s: it is not the file that was moved",
                    relpath,
                    tier.name,
                )
                return False
            os.unlink(name, dir_fd=dfd)
            if between is not None:
                between()
            os.fsync(dfd)
            return True
        finally:
            os.close(dfd)

    def _unlink_published(self, tier: Tier, relpath: str, pub: Published) -> None:
        try:
            dirs, name = split_relpath(relpath)
            dfd = tier.open_dir(dirs)
            try:
                cur = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if (cur.st_dev, cur.st_ino) == (pub.dev, pub.ino):
                    os.unlink(name, dir_fd=dfd)
                    os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            log.error("could not remove the aborted copy of %r on %s: %s", relpath, tier.name, exc)

    def _remove_source(self, src: Tier, relpath: str, st0: os.stat_result) -> None:
        if self._unlink_if_same(src, relpath, st0, lambda: self._at("source_unlinked")):
            self._at("source_removed")

    @staticmethod
    def _remove_temp(tier: Tier, relpath: str, temp_name: str) -> bool:
        return tier.unlink(relpath, name=temp_name)

    @staticmethod
    def _probe(tier: Tier, relpath: str) -> tuple[str, os.stat_result] | None:
        """Checksum and stat of the regular file at ``relpath`` on ``tier``, or None."""
        try:
            fd, st = tier.open_read(relpath)
        except (FileNotFound, InvalidPath):
            return None
        try:
            return hash_fd(fd), st
        finally:
            os.close(fd)

    # -- recovery ----------------------------------------------------------------------------
    def recover(self) -> RecoveryReport:
        """Settle every intent a crash left open; run before serving. Idempotent.

        ``copying``: the source is authoritative; the temp and any copy at B are removed.
        ``switched``: B is authoritative; the source is removed. When only one side still
        holds verified bytes, that side is kept. Anything else is quarantined and nothing is
        deleted.
        """
        report = RecoveryReport()
        for intent in self.journal.open_intents():
            try:
                self._recover(intent, report)
            except (OSError, TierdError) as exc:
                why = f"recovery could not decide: {exc}; nothing was deleted"
                log.error("migration %d of %r: %s", intent.id, intent.relpath, why)
                self.journal.quarantine(intent, error=why)
                report.quarantined.append(intent.id)
        report.unstuck = self.journal.unstick()
        return report

    def _recover(self, intent: Migration, report: RecoveryReport) -> None:
        try:
            src, dst = self.tiers.get(intent.src_tier), self.tiers.get(intent.dst_tier)
        except TierNotFound as exc:
            raise IntegrityError(f"tier no longer configured: {exc.message}") from exc
        rec = self.catalog.find(intent.relpath)
        if rec is None or rec.id != intent.file_id:
            # The file was deleted: only the temp is ours for sure.
            self._remove_temp(dst, intent.relpath, intent.temp_name)
            self.journal.release(intent, phase=MigrationPhase.ABORTED, error="file deleted")
            report.aborted.append(intent.id)
            return
        expected = rec.checksum
        a = self._probe(src, intent.relpath)
        b = self._probe(dst, intent.relpath)

        def ok(side: tuple[str, os.stat_result] | None) -> bool:
            return side is not None and side[0] == expected

        if intent.phase == MigrationPhase.COPYING:
            if a is not None and (expected is None or a[0] == expected):
                self._remove_temp(dst, intent.relpath, intent.temp_name)
                if b is not None and b[0] == a[0]:
                    self._unlink_if_same(dst, intent.relpath, b[1])
                elif b is not None:
                    log.warning(
                        "%r on tier %s differs from the source; left for a person",
                        intent.relpath,
                        dst.name,
                    )
                self.journal.relocate(
                    intent,
                    tier=src.name,
                    phase=MigrationPhase.ABORTED,
                    error="interrupted by a restart; the source was kept",
                    checksum=a[0],
                )
                report.aborted.append(intent.id)
                return
            if a is None and expected is not None and ok(b):
                self._remove_temp(dst, intent.relpath, intent.temp_name)
                self.journal.relocate(
                    intent,
                    tier=dst.name,
                    phase=MigrationPhase.DONE,
                    error="the source was lost; the verified copy at the destination was kept",
                )
                report.relocated.append(intent.id)
                return
        elif intent.phase == MigrationPhase.SWITCHED:
            if ok(b):
                self._remove_temp(dst, intent.relpath, intent.temp_name)
                if a is not None and a[0] == expected:
                    self._unlink_if_same(src, intent.relpath, a[1])
                elif a is not None:
                    log.warning(
                        "%r on tier %s is not the moved file; left for a person",
                        intent.relpath,
                        src.name,
                    )
                self.journal.finish(intent.id)
                report.finished.append(intent.id)
                return
            if b is None and ok(a):
                self._remove_temp(dst, intent.relpath, intent.temp_name)
                self.journal.relocate(
                    intent,
                    tier=src.name,
                    phase=MigrationPhase.FAILED,
                    error="the copy at the destination was lost after the switch; the source "
                    "was kept",
                )
                report.relocated.append(intent.id)
                return
        sides = f"source {'absent' if a is None else 'present'}, destination " + (
            "absent" if b is None else "present"
        )
        why = (
            f"recovery of a {intent.phase} move could not decide which copy is right ({sides}, "
            f"neither both verified against {expected}); nothing was deleted"
        )
        log.error("migration %d of %r: %s", intent.id, intent.relpath, why)
        self.journal.quarantine(intent, error=why)
        report.quarantined.append(intent.id)
