"""The copy process: copies and hashes the bytes of moves, outside the process that serves.

Run as a script by its path (``python _copyworker.py CTL_FD NICE``), never imported by tierd's
package: it needs the standard library and :mod:`tiering.checksum` only, so it starts in tens
of milliseconds. :mod:`tiering.moves._copyproc` starts it and speaks its protocol; the reasons
are there.

Protocol, over ``AF_UNIX`` ``SOCK_SEQPACKET`` sockets (one message a datagram):

- on the control socket, one message per move, ``b"m"`` with three descriptors: the move's
  channel, its source and its destination (the writer's unpublished temp file);
- on a move's channel, the parent's requests and the replies, one a request:
  ``b"c" + <Q n>`` copy the next at most ``n`` bytes (``pread`` then ``pwrite`` at the same
  offset, hashed) and reply ``b"k" + <Q got>`` (0 at the source's end), or
  ``b"x" + <i errno> + what`` ("read" or "write") on an error, after which the move is over;
  ``b"e"`` end: reply ``b"h" + checksum`` (``xxh3_128:<hex>``) and close.

The process writes only when asked, a chunk at a time: when the parent dies its sockets close,
the chunk in hand is the last, and the process exits at the control socket's end.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiering.checksum import Hasher

Writeback = Callable[[int, int, int, int], int]

#: Bytes written between two writeback requests (as tiering.tiers' writers do: the final fsync
#: then finds little left to write).
_WRITEBACK_STEP = 16 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _writeback() -> Writeback | None:
    """``sync_file_range`` where libc has it, else None (a hint only; see the tiers' writers)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def _serve(
    chan: socket.socket, src: int, dst: int, hasher: Hasher, writeback: Writeback | None
) -> None:
    """One move's channel: chunks on request until the end, an error or the parent's end."""
    buf = bytearray(0)
    off = written_back = 0
    try:
        while True:
            req = chan.recv(64)
            if not req:
                return  # the parent is gone or gave the move up
            if req[:1] == b"e":
                chan.send(b"h" + hasher.value().encode())
                return
            (n,) = struct.unpack("<Q", req[1:9])
            if len(buf) < n:
                buf = bytearray(n)
            view = memoryview(buf)[:n]
            what = "read"
            try:
                got = 0
                while got < n:
                    r = os.preadv(src, [view[got:]], off + got)
                    if r == 0:
                        break
                    got += r
                what = "write"
                done = 0
                while done < got:
                    done += os.pwrite(dst, view[done:got], off + done)
            except OSError as exc:
                chan.send(b"x" + struct.pack("<i", exc.errno or 0) + what.encode())
                return
            hasher.update(view[:got])
            off += got
            if writeback is not None and off - written_back >= _WRITEBACK_STEP:
                writeback(dst, written_back, off - written_back, _SYNC_FILE_RANGE_WRITE)
                written_back = off
            chan.send(b"k" + struct.pack("<Q", got))
    except OSError:
        return  # the channel broke: the parent is gone
    finally:
        os.close(src)
        os.close(dst)
        chan.close()


def main(argv: list[str]) -> int:
    ctl = socket.socket(fileno=int(argv[1]))
    nice = int(argv[2])
    if nice > 0:
        with contextlib.suppress(OSError):
            os.nice(nice)  # every thread of this process: it only copies
    from tiering.checksum import Hasher

    writeback = _writeback()
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(ctl, 16, 3)
        except OSError:
            return 0
        if not msg:
            return 0  # the parent closed the control socket, or died
        chan_fd, src, dst = fds
        chan = socket.socket(fileno=chan_fd)
        threading.Thread(
            target=_serve, args=(chan, src, dst, Hasher(), writeback), daemon=True
        ).start()


if __name__ == "__main__":
    # Run by path: its directory is sys.path[0]; tierd's package root goes there instead.
    sys.path[0] = str(Path(__file__).resolve().parents[2])
    sys.exit(main(sys.argv))
