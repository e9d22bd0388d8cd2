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
  offset, both around the page cache where the filesystem allows, hashed) and reply
  ``b"k" + <Q got>`` (0 at the source's end), or
  ``b"x" + <i errno> + what`` ("read" or "write") on an error, after which the move is over;
  ``b"e"`` end: reply ``b"h" + checksum`` (``xxh3_128:<hex>``) and close.

The process writes only when asked, a chunk at a time: when the parent dies its sockets close,
the chunk in hand is the last, and the process exits at the control socket's end.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
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
#: Direct writes' alignment: a page, a multiple of every Linux block device's logical block.
_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
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


class _Around:
    """A file handed over as ``fd``, also opened again with ``O_DIRECT`` where its filesystem
    allows (``/proc/self/fd``): the descriptor handed over shares its open file with the
    server, and the flag set on it would change the server's reads and writes too.

    :meth:`_io` goes around the page cache only where the offset is aligned (the buffer is
    page-aligned memory, every chunk but the last a multiple of :data:`_ALIGN`); a call the
    filesystem refuses with ``EINVAL`` (a device with larger blocks) turns direct I/O off for
    the rest of the file and is made again through the page cache.
    """

    def __init__(self, fd: int, access: int) -> None:
        self.fd = fd
        # None where the filesystem refuses direct I/O (tmpfs on older kernels, some FUSE
        # ones), and once a call has turned it off.
        self._direct: int | None = None
        if _O_DIRECT:
            with contextlib.suppress(OSError):
                flags = access | _O_DIRECT | os.O_CLOEXEC
                self._direct = os.open(f"/proc/self/fd/{fd}", flags)

    @property
    def direct(self) -> bool:
        """Whether I/O goes around the page cache now."""
        return self._direct is not None

    def close(self) -> None:
        """Stop going around the page cache (the descriptor handed over stays open)."""
        fd, self._direct = self._direct, None
        if fd is not None:
            os.close(fd)

    def _io(self, call: Callable[[int, memoryview, int], int], view: memoryview, off: int) -> int:
        fd = None if off % _ALIGN else self._direct
        try:
            return call(self.fd if fd is None else fd, view, off)
        except OSError as exc:
            if fd is None or exc.errno != errno.EINVAL:
                raise
            self.close()
            return call(self.fd, view, off)


class _Destination(_Around):
    """The temp file, written around the page cache where its filesystem allows.

    A move's bytes go to disk, not to memory: written through the page cache, each move's
    bytes are copied once more by the CPU, dirty the host's memory, and are written back by the
    kernel's flusher threads at the server's priority, not this process's nice 19. On two
    cores shared with 16 client processes (``tierd bench serving``, two 24 MiB files moving at
    the 256 MiB/s cap; four runs of each, alternated), that work was in the requests' tail: the
    4 KiB reads' p99 while moving was 1.34-2.80x idle (median 1.61x) with buffered writes and
    1.19-2.01x (median 1.23x) with direct ones; the rate (0.80x) and the moves did not change.
    The move's fsync still makes the bytes durable (a direct write can sit in the device's
    cache), and the file's page cache, empty, evicts no other file's pages as it fills. A
    write whose length is not aligned (the file's tail) turns direct writes off, as a refused
    one does (see :class:`_Around`).
    """

    def __init__(self, fd: int, writeback: Writeback | None) -> None:
        super().__init__(fd, os.O_WRONLY)
        self._writeback = writeback
        self._written_back = 0

    def write(self, view: memoryview, off: int) -> None:
        """All of ``view`` at ``off``."""
        if len(view) % _ALIGN or off % _ALIGN:
            self.close()
        done = 0
        while done < len(view):
            done += self._io(os.pwrite, view[done:], off + done)
        end, since = off + len(view), self._written_back
        if not self.direct and self._writeback is not None and end - since >= _WRITEBACK_STEP:
            self._writeback(self.fd, since, end - since, _SYNC_FILE_RANGE_WRITE)
            self._written_back = end


class _Source(_Around):
    """The source, read around the page cache where its filesystem allows.

    A read through the page cache is one more copy of a move's bytes by the CPU, through the
    caches the server's requests run from. A direct read has the device put the bytes in the
    buffer (the kernel first writes back any of the file's dirty pages in the range, so it
    reads what a buffered read would). A read after a short one (the file's end) is not
    aligned, and goes through the page cache.
    """

    def __init__(self, fd: int) -> None:
        super().__init__(fd, os.O_RDONLY)

    def read(self, view: memoryview, off: int) -> int:
        """Fill ``view`` from ``off``, up to the file's end; the bytes read."""
        got = 0
        while got < len(view):
            r = self._io(_preadv, view[got:], off + got)
            if r == 0:
                break
            got += r
        return got


def _preadv(fd: int, view: memoryview, off: int) -> int:
    return os.preadv(fd, [view], off)


class _Buffers:
    """Chunk buffers kept from one move to the next.

    A new buffer's pages are faulted in and zeroed by the kernel as the first chunk is read
    into them: on the 2-core machine a move's first 16 MiB chunk, into a new buffer, took
    27 ms (13 ms of CPU), and its next 8 MiB, into the same pages, 2.3 ms. The copy process
    keeps at most :data:`KEEP` of them between moves (one per mover at a time).
    """

    KEEP = 4

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, _ALIGN)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self.KEEP:
                self._free.append(buf)
                return
        with contextlib.suppress(BufferError):  # a view still held: the collector frees it
            buf.close()


_buffers = _Buffers()


def _serve(
    chan: socket.socket, src: int, dst: int, hasher: Hasher, writeback: Writeback | None
) -> None:
    """One move's channel: chunks on request until the end, an error or the parent's end."""
    buf = _buffers.take()
    given = False
    off = 0
    source = _Source(src)
    out = _Destination(dst, writeback)
    try:
        while True:
            req = chan.recv(64)
            if not req:
                return  # the parent is gone or gave the move up
            if req[:1] == b"e":
                # The buffer goes back before the answer: the server's next move may start as
                # soon as it has it, and must find the buffer kept, not make one again.
                _buffers.give(buf)
                given = True
                chan.send(b"h" + hasher.value().encode())
                return
            (n,) = struct.unpack("<Q", req[1:9])
            if len(buf) < n:
                buf.close()
                buf = mmap.mmap(-1, n)  # page-aligned, as direct writes need
            what = "read"
            view = memoryview(buf)[:n]
            try:
                got = source.read(view, off)
                what = "write"
                out.write(view[:got], off)
                hasher.update(view[:got])
            except OSError as exc:
                chan.send(b"x" + struct.pack("<i", exc.errno or 0) + what.encode())
                return
            finally:
                view.release()  # before the buffer can go to another move
            off += got
            chan.send(b"k" + struct.pack("<Q", got))
    except OSError:
        return  # the channel broke: the parent is gone
    finally:
        source.close()
        out.close()
        os.close(src)
        os.close(dst)
        chan.close()
        if not given:
            _buffers.give(buf)


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
