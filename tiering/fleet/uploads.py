"""What this host gives the other hosts of its fleet: which verified bytes of a file's generation
serve a peer's range, and how many peer bodies it sends at once.

A peer read (``GET /v1/peer/content``) is served from bytes this host has verified itself,
never from the file's authority elsewhere (the bucket, another host), in this order:

- its copy in the memory tier (filled and checked against the catalog), ``memory``;
- its host copy on one of its directory tiers (checked when filled), ``copy``;
- the file itself, when the file lives on a tier of this host, ``tier``;
- the pieces its fill of a host copy has verified so far (a relay: a chain or tree of hosts
  streams at once), only of the generation being filled and only a range whose every piece is
  verified, ``filling``.

A host serves at most :data:`MAX_UPLOADS` peer bodies at once: past it :class:`PeerBusy` sends
the receiver to another holder, so a host that just got the only copy of a piece is not asked
for it by the whole fleet at once, and receivers spread over the hosts that relay it. A slot is
held from the choice of source until the body ends, however it ends (sent, cut off by the
client, or never started and collected).

The REST layer (``app/api/peer.py``) parses, authorizes and streams; the choice is made here.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Protocol

from tiering.catalog import FileRecord
from tiering.fleet.peerfetch import NotHeld, PeerBusy
from tiering.moves import Content
from tiering.tiers import MemoryEntry, MemoryTier

__all__ = ["MAX_UPLOADS", "PeerBody", "PeerUploads"]

#: Peer bodies one host serves at once; past it, :class:`PeerBusy` (429 ``peer_busy``).
MAX_UPLOADS = 4
#: Bytes per chunk of a body handed to the server.
CHUNK = 1 << 20


class Filling(Protocol):
    """A fill of a host copy in flight (``tiering.copies.PieceFill``)."""

    generation: int

    def read_range(self, start: int, end: int) -> bytes | None: ...


class HeldCopies(Protocol):
    """This host's copies of a fleet's files on its own tiers (``tiering.copies.HostCopies``)."""

    def content(self, file_id: int) -> Content | None: ...

    def filling(self, file_id: int) -> Filling | None: ...


class PeerBody:
    """The bytes ``[start, end)`` of one verified source, holding that source and an upload slot
    until the body ends: at its last chunk, when the client went away mid-body, or, for a body
    never started, when it is collected (a memory copy held forever could not be dropped)."""

    def __init__(
        self, source: str, size: int, chunks: Iterator[bytes], release: Callable[[], None]
    ) -> None:
        #: Where on this host the bytes come from: ``memory``, ``copy``, ``tier`` or ``filling``.
        self.source = source
        #: The file's size (the generation's).
        self.size = size
        self._chunks = chunks
        self._release = release
        self._lock = threading.Lock()
        self._released = False

    def release(self) -> None:
        """Let go of the source and the slot; only the first call does anything."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._release()

    def stream(self, count: Callable[[int], None]) -> Iterator[bytes]:
        """The body's chunks, each passed to ``count`` as it is handed on."""

        def gen() -> Iterator[bytes]:
            try:
                for chunk in self._chunks:
                    count(len(chunk))
                    yield chunk
            finally:
                self.release()

        out = gen()
        weakref.finalize(out, self.release)
        return out


class PeerUploads:
    """Chooses the verified source of a peer's range and holds the upload slots.

    Parameters
    ----------
    memory:
        The memory tier, or None.
    copies:
        This host's host copies (and their fills in flight), or None.
    host_id:
        This host's id: a file whose record names it lives on a tier here.
    open_own:
        Opens a file of this host's own tiers (the engine's one content path, which counts an
        access: a peer's read of a file is a read of it).
    """

    def __init__(
        self,
        *,
        memory: MemoryTier | None,
        copies: HeldCopies | None,
        host_id: str,
        open_own: Callable[[int], Content],
        max_uploads: int = MAX_UPLOADS,
    ) -> None:
        self._memory = memory
        self._copies = copies
        self._host_id = host_id
        self._open_own = open_own
        self.max_uploads = max_uploads
        self._slots = threading.BoundedSemaphore(max_uploads)

    def open(self, rec: FileRecord, start: int, end: int) -> PeerBody:
        """The body of ``[start, end)`` of ``rec``'s generation (the caller checked that it is
        the catalog's current one), from the first source that holds it verified.

        Raises
        ------
        PeerBusy
            :attr:`max_uploads` bodies are being sent already.
        NotHeld
            This host holds no verified bytes of that range of that generation.
        """
        if not self._slots.acquire(blocking=False):
            raise PeerBusy(f"this host serves {self.max_uploads} peer reads already; ask another")
        try:
            body = self._held(rec, start, end) or self._filling(rec, start, end)
        except BaseException:
            self._slots.release()
            raise
        if body is None:
            self._slots.release()
            raise NotHeld(
                f"this host holds no verified bytes of {rec.relpath!r} at {rec.generation}"
            )
        return body

    def _held(self, rec: FileRecord, start: int, end: int) -> PeerBody | None:
        """The memory copy, the host copy, or the own file, at ``rec``'s generation and size."""
        if self._memory is not None:
            entry = self._memory.acquire(rec.id, rec.generation)
            if entry is not None:
                if entry.size == rec.size:
                    return self._of_memory(self._memory, entry, start, end)
                self._memory.release(entry)
        content = self._copies.content(rec.id) if self._copies is not None else None
        if content is not None:
            return self._of_content("copy", content, start, end)
        if rec.host is not None and rec.host == self._host_id:
            # The file lives on a tier of this host: its own fd, at the generation it opened.
            own = self._open_own(rec.id)
            if own.record.generation == rec.generation and own.size == rec.size:
                return self._of_content("tier", own, start, end)
            own.close()
        return None

    def _filling(self, rec: FileRecord, start: int, end: int) -> PeerBody | None:
        """The range from this host's fill in flight when every piece it touches is verified
        (read now, so the fill may end while the body streams)."""
        fill = self._copies.filling(rec.id) if self._copies is not None else None
        if fill is None or fill.generation != rec.generation or rec.size == 0:
            return None
        data = fill.read_range(start, end)
        if data is None:
            return None
        return PeerBody("filling", rec.size, iter((data,)), self._slots.release)

    def _of_content(self, source: str, content: Content, start: int, end: int) -> PeerBody:
        def release() -> None:
            try:
                content.close()
            finally:
                self._slots.release()

        return PeerBody(source, content.size, content.iter_range(start, end, CHUNK), release)

    def _of_memory(self, tier: MemoryTier, entry: MemoryEntry, start: int, end: int) -> PeerBody:
        def chunks() -> Iterator[bytes]:
            view = entry.view()
            for pos in range(start, end, CHUNK):
                yield view[pos : min(end, pos + CHUNK)].tobytes()

        def release() -> None:
            try:
                tier.release(entry)
            finally:
                self._slots.release()

        return PeerBody("memory", entry.size, chunks(), release)
