"""Step 4 of a move: its bytes copied and hashed in one streaming pass, at a pace that yields
to serving: in the copy process (:mod:`tiering.moves._copyproc`) when both ends are local files
of at least ``process_min`` bytes, else on a thread of its own at a lower priority.

:class:`~tiering.moves.steps.MoveRunner` runs the protocol's steps; this is the one step that
takes time in proportion to the file, and the one that competes with serving for the cores.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from tiering.moves._copyproc import CopyProcess, WorkerGone
from tiering.moves.concurrency import (
    Claim,
    Progress,
    ProgressBoard,
    RateLimiter,
    ServingGate,
    lower_priority,
)
from tiering.moves.failures import Cancelled, storage_error
from tiering.tiers import Source, Tier, Writer

__all__ = [
    "CHUNK",
    "COPY_NICE",
    "PROCESS_CHUNK",
    "PROCESS_MIN",
    "PROCESS_NICE",
    "Copier",
    "MoveSettings",
    "Pace",
]

CHUNK = 4 << 20
#: How many nice levels below the process the thread that copies a move's bytes runs.
COPY_NICE = 10
#: Files from this size on are copied in the copy process (see :mod:`tiering.moves._copyproc`).
#: A smaller file's copy is a few system calls: the messages to the process would cost more.
PROCESS_MIN = 8 << 20
#: Bytes the copy process copies per request. Larger than :data:`CHUNK`: each request wakes
#: the move's thread in the server (its GIL) and each write is an event for the file watcher,
#: while the copy costs the server nothing; a rest still follows every chunk.
PROCESS_CHUNK = 16 << 20
#: Nice levels below the server for the copy process: the lowest. It holds nothing the server
#: waits for (unlike a copy thread, which takes the server's GIL back after each system call
#: and so stays at :data:`COPY_NICE`), so it can take only what the cores leave. Measured with
#: ``tierd bench serving`` beside nice 10 and 0, two runs each: request rate while moving 0.83x
#: and 0.82x (nice 10: 0.84x, 0.78x; nice 0: 0.78x), moves 1.42x and 1.35x their time alone.
PROCESS_NICE = 19


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
    #: Files of at least this many bytes, local at both ends, are copied in the copy process;
    #: None copies every file in this process.
    process_min: int | None = PROCESS_MIN
    #: Bytes per request to the copy process.
    process_chunk: int = PROCESS_CHUNK
    #: Nice levels below the server for the copy process (read when it starts).
    process_nice: int = PROCESS_NICE
    #: Test-only: called with each step's name (see STEPS).
    hook: Callable[[str], None] | None = None

    def at(self, step: str) -> None:
        """A move reached ``step``: tell the hook, if any."""
        if self.hook is not None:
            self.hook(step)


_POLL_S = (0.001, 0.016)  # a move looks whether its copy has finished: first, then at most


@dataclass
class Pace:
    """A move's work since it last rested, for :class:`ServingGate`: the move rests after each
    chunk it copies, and once at its end for its other steps (open, sync, publish, switch,
    unlink), so every step of it yields to serving, not the copy alone."""

    gate: ServingGate
    cancel: threading.Event | None
    since: float = field(default_factory=time.monotonic)

    def after_chunk(self, limiter: RateLimiter, n: int) -> None:
        """After a chunk of ``n`` bytes: wait for the bandwidth cap, then rest (while serving
        is busy) for the time the chunk took, the cap's wait included. A move's cost to
        serving is per move and per byte, whatever part of its time it waits: resting for
        its whole time makes it ``1 + share`` times slower and as many times less often a
        cost (a rest for the copy's time alone, under a cap, slowed moves by 1.10x and left
        the requests 0.76x their idle rate)."""
        limiter.acquire(n, self.cancel)
        if self.gate.rest(time.monotonic() - self.since, self.cancel):
            limiter.hold()
        self.since = time.monotonic()


class Copier:
    """Step 4 of every move of one mover: ``settings`` (chunk size, priority, the test hook),
    ``board`` (where a move posts its bytes copied) and ``limiter`` (the bandwidth cap)."""

    def __init__(self, settings: MoveSettings, board: ProgressBoard, limiter: RateLimiter) -> None:
        self.settings = settings
        self.board = board
        self.limiter = limiter
        #: Started at the first move that uses it; :meth:`close` stops it.
        self.process = CopyProcess(settings.process_nice)

    def close(self) -> None:
        """Stop the copy process, if one runs."""
        self.process.close()

    def copy(
        self,
        claim: Claim,
        source: Source,
        writer: Writer,
        size: int,
        progress: Progress | None,
        pace: Pace,
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
        outside = self._outside(source, writer, size)
        if outside is not None:
            return self._copy_outside(claim, *outside, writer, size, progress, pace)
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

    def _outside(self, source: Source, writer: Writer, size: int) -> tuple[int, int] | None:
        """The source's and the temp file's descriptors when the copy process copies, else
        None (a small file, a remote end, a compressed one, or the process turned off)."""
        least = self.settings.process_min
        if least is None or size < least:
            return None
        local, dst = source.local_file(), writer.local_fd()
        if local is None or dst is None:
            return None
        return local.fd, dst

    def _copy_outside(
        self,
        claim: Claim,
        src_fd: int,
        dst_fd: int,
        writer: Writer,
        size: int,
        progress: Progress | None,
        pace: Pace,
    ) -> int:
        """Step 4 in the copy process: one chunk at a time, paced here as :meth:`_copy_loop`
        paces its own (progress, rests, the cap, cancel); this thread sleeps in ``recv``
        while the process copies."""
        self.process.nice = self.settings.process_nice
        rel, cancel, iid = claim.record.relpath, pace.cancel, claim.intent.id
        try:
            chan = self.process.open(src_fd, dst_fd)
        except OSError as exc:
            raise storage_error(exc, f"starting the copy of {rel!r}") from exc
        off = 0
        try:
            while True:
                if cancel is not None and cancel.is_set():
                    raise Cancelled("the engine is stopping; the move was abandoned")
                try:
                    n = chan.copy(self.settings.process_chunk)
                except WorkerGone as exc:
                    raise storage_error(exc, f"copying {rel!r}") from exc
                except OSError as exc:
                    where = (
                        f"reading {rel!r}"
                        if exc.filename == "read"
                        else f"writing to tier {writer.tier.name}"
                    )
                    raise storage_error(exc, where) from exc
                if n == 0:
                    break
                off += n
                self.board.set(iid, off)
                if progress is not None:
                    progress(off, size)
                if off == n:
                    self.settings.at("copying")
                pace.after_chunk(self.limiter, n)
            try:
                checksum = chan.finish()
            except OSError as exc:
                raise storage_error(exc, f"copying {rel!r}") from exc
        finally:
            chan.close()
        writer.written_outside(off, checksum)
        return off

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
        pace: Pace,
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
            pace.after_chunk(self.limiter, n)
            chunk = self._next(claim, chunks, cancel, stop)
        return off
