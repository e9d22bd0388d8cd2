"""Step 4's data path in a process of its own: the server only steers the copy.

Measured with ``tierd bench serving`` on the 2-core machine (16 client processes, two 24 MiB
files moving at about 120 MiB/s): with the copy on a thread of the server (at nice 10), busy
windows served 0.72-0.87x the idle rate and the 4 KiB reads' p99 rose 1.0-1.8x; the same
bytes copied by another process (``dd`` with ``fsync``, the same pace) cost the requests
0.97x and 1.12x. The bytes cost the machine little; what costs is where they are copied. A
copy thread in the server takes the GIL back after every system call (the read, the write, the
hash), and the interpreter hands it over: the event loop stops at its next switch point until
that thread, a low-priority one on cores shared with 16 clients, has run. In a process of its
own the copy never takes the server's GIL; the move's thread asks for one chunk at a time and
sleeps in ``recv`` meanwhile (its pacing, the bandwidth cap and :class:`ServingGate`'s rests
stay in the server, unchanged).

The process (:mod:`tiering.moves._copyworker`) starts at the first move that uses it and serves
every move of its :class:`~tiering.moves.Mover` (a thread each), at ``process_nice`` (19)
below the server. Each move hands it the source's and the temp file's descriptors over a socket (the
temp file is made, synced, verified and published by the server's writer, as before). The
process writes only a chunk at a time, when asked: if the server dies, its sockets close and
the chunk in hand is the last one written (recovery then removes the temp, as for any crash
mid-copy). If the process dies, the move in flight fails cleanly (the source stays) and the
next move starts a new one.
"""

from __future__ import annotations

import logging
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

__all__ = ["Channel", "CopyProcess", "WorkerGone"]

log = logging.getLogger(__name__)

_WORKER = Path(__file__).with_name("_copyworker.py")
_STOP_S = 5.0  # at most, for the process to exit once told to


class WorkerGone(OSError):
    """The copy process ended (or its channel broke) while a move was using it."""


class Channel:
    """One move's conversation with the copy process (see the worker's protocol)."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self._sock = sock
        #: The copy process's pid (what a test checks: the bytes are copied there).
        self.pid = pid

    def _ask(self, msg: bytes) -> bytes:
        try:
            self._sock.send(msg)
            reply = self._sock.recv(256)
        except OSError as exc:
            raise WorkerGone(exc.errno, f"the copy process is gone: {exc}") from exc
        if not reply:
            raise WorkerGone(0, "the copy process is gone")
        return reply

    def copy(self, n: int) -> int:
        """Copy (and hash) the next at most ``n`` bytes; returns how many (0 at the end).

        Raises the ``OSError`` the process met, with ``filename`` "read" or "write"."""
        reply = self._ask(b"c" + struct.pack("<Q", n))
        if reply[:1] == b"k":
            got: int = struct.unpack("<Q", reply[1:9])[0]
            return got
        if reply[:1] == b"x":
            (err,) = struct.unpack("<i", reply[1:5])
            raise OSError(err, _strerror(err), reply[5:].decode())
        raise WorkerGone(0, f"the copy process answered {reply[:16]!r}")

    def finish(self) -> str:
        """The checksum of every byte copied (``xxh3_128:<hex>``); ends the move's channel."""
        reply = self._ask(b"e")
        if reply[:1] != b"h":
            raise WorkerGone(0, f"the copy process answered {reply[:16]!r}")
        return reply[1:].decode()

    def close(self) -> None:
        self._sock.close()


def _strerror(err: int) -> str:
    import os

    try:
        return os.strerror(err)
    except ValueError:
        return f"error {err}"


class CopyProcess:
    """The copy process of one mover: started on first use, restarted if it died, stopped by
    :meth:`close`.

    Parameters
    ----------
    nice:
        Nice levels below the server for the process (it only copies).
    """

    def __init__(self, nice: int) -> None:
        self.nice = nice
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._ctl: socket.socket | None = None
        #: Processes started so far (a test sees a restart).
        self.starts = 0

    @property
    def pid(self) -> int | None:
        """The running process's pid, or None."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def _start(self) -> tuple[subprocess.Popen[bytes], socket.socket]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen(
                [sys.executable, str(_WORKER), str(theirs.fileno()), str(max(0, self.nice))],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.starts += 1
        log.debug("copy process %d started", proc.pid)
        return proc, ours

    def open(self, src_fd: int, dst_fd: int) -> Channel:
        """A channel for one move copying ``src_fd`` into ``dst_fd`` (both stay the caller's:
        the process works on its own duplicates)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with self._lock:
                for attempt in (0, 1):
                    if self._proc is None or self._proc.poll() is not None:
                        self._stop_locked()
                        self._proc, self._ctl = self._start()
                    assert self._proc is not None and self._ctl is not None
                    try:
                        socket.send_fds(self._ctl, [b"m"], [theirs.fileno(), src_fd, dst_fd])
                        break
                    except OSError:
                        if attempt:
                            raise
                        self._stop_locked()  # it died since: once more, with a new one
                pid = self._proc.pid if self._proc is not None else 0
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return Channel(ours, pid)

    def _stop_locked(self) -> None:
        proc, ctl = self._proc, self._ctl
        self._proc = self._ctl = None
        if ctl is not None:
            ctl.close()  # the process exits at the control socket's end
        if proc is not None:
            try:
                proc.wait(timeout=_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        """Stop the process (a move still copying fails cleanly at its next chunk)."""
        with self._lock:
            self._stop_locked()
