"""The CPU decoder: a container opened through positioned reads, read by logical ranges."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from tiering.codec._format import (
    FOOTER,
    FRAME,
    HEADER,
    MAGIC,
    ChunkEntry,
    CorruptContainer,
    Footer,
    Kind,
    digest,
    frame_spans,
    read_frame_table,
    unpack_index,
)

if TYPE_CHECKING:
    import zstandard

__all__ = ["ChunkDecoder", "Container", "ReadAt", "ReadInto", "is_container"]

ReadAt = Callable[[int, int], bytes | bytearray]
"""``read(n, offset)``: ``n`` bytes of the stored file at ``offset`` (fewer only at its end;
bytes or a bytearray the reader made for them)."""
ReadInto = Callable[[memoryview, int], int]
"""``read_into(view, offset)``: the stored file's bytes at ``offset`` into ``view``; how many
(fewer only at its end)."""

#: Decoded chunks an open container keeps: a reader going forward in pieces smaller than a
#: chunk decodes each chunk once, and two readers' interleaved ranges do not thrash.
_CACHED = 2


def is_container(first: bytes, size: int) -> bool:
    """Whether a stored file of ``size`` bytes whose first bytes are ``first`` is a container
    (its footer then tells for sure: :meth:`Container.open`)."""
    return size >= HEADER + FOOTER and first[:HEADER] == MAGIC


class Container:
    """A container opened for reading: its logical bytes by range (see the package).

    Thread-safe: ranges may be read from several threads at once (each decodes its chunks;
    zstd releases the GIL). Every chunk decoded is checked against its digest, and a mismatch
    raises :class:`CorruptContainer` naming ``name`` and the chunk, never returns bytes.
    """

    def __init__(
        self,
        name: str,
        read: ReadAt,
        stored_size: int,
        footer: Footer,
        index: list[ChunkEntry],
        read_into: ReadInto | None = None,
    ) -> None:
        self.name = name
        self.stored_size = stored_size
        self.footer = footer
        self.size = footer.logical_size
        self.chunk_size = footer.chunk_size
        self.index = index
        self._read = read
        self._read_into = read_into
        self._chunks = ChunkDecoder(name)
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()

    @classmethod
    def open(cls, name: str, read: ReadAt, stored_size: int) -> Container:
        """Read and check the footer and index of the ``stored_size`` byte container."""
        if stored_size < HEADER + FOOTER:
            raise CorruptContainer(f"{name}: too short to be a compressed file", path=name)
        footer = Footer.unpack(read(FOOTER, stored_size - FOOTER), name)
        if footer.index_offset + footer.index_length != stored_size - FOOTER:
            raise CorruptContainer(f"{name}: the footer's index is out of place", path=name)
        raw = read(footer.index_length, footer.index_offset) if footer.index_length else b""
        return cls(name, read, stored_size, footer, unpack_index(raw, footer, stored_size, name))

    def reading(self, read: ReadAt, read_into: ReadInto | None = None) -> Container:
        """The same container read through ``read`` (and ``read_into``, where the reader can
        read into a caller's buffer; its footer and index not read again)."""
        return Container(self.name, read, self.stored_size, self.footer, self.index, read_into)

    def logical_length(self, c: int) -> int:
        """How many logical bytes chunk ``c`` holds (all but the last: the chunk size)."""
        return min(self.chunk_size, self.size - c * self.chunk_size)

    def read_stored(self, c: int, into: memoryview) -> memoryview:
        """Chunk ``c``'s stored bytes read into the start of ``into`` (flat bytes, at least
        the chunk's stored length) and checked against their digest: for a decoder that does
        not see the logical bytes on the host (a GPU's). Returns the part of ``into`` filled.
        """
        e = self.index[c]
        view = into[: e.length]
        if self._read_into is not None:
            got = self._read_into(view, e.offset)
        else:
            data = self._read(e.length, e.offset)
            got = len(data)
            view[:got] = data
        if got != e.length:
            raise self.corrupt(c, "it is cut short")
        if digest(view) != e.stored_xxh3:
            raise self.corrupt(c, "its stored bytes do not match their checksum")
        return view

    def corrupt(self, c: int, why: str) -> CorruptContainer:
        """The error for chunk ``c`` found damaged (``why``), naming the file and the chunk."""
        return self._chunks.corrupt(c, why)

    # -- reading -------------------------------------------------------------------------------
    def readinto(self, buf: memoryview, offset: int) -> int:
        """Read up to ``len(buf)`` logical bytes at ``offset``; fewer only at the end."""
        view = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
        n = max(0, min(len(view), self.size - offset))
        done = 0
        while done < n:
            at = offset + done
            c, within = divmod(at, self.chunk_size)
            whole = min(self.chunk_size, self.size - c * self.chunk_size)
            if within == 0 and n - done >= whole and not view.readonly:
                # A whole chunk: decoded straight into the caller's buffer (no copy, no cache).
                self._decode(c, np.frombuffer(view[done : done + whole], dtype=np.uint8))
                done += whole
                continue
            data = self.chunk(c)
            take = min(n - done, len(data) - within)
            view[done : done + take] = data[within : within + take].data
            done += take
        return n

    def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(max(0, min(length, self.size - offset)))
        self.readinto(memoryview(buf), offset)
        return bytes(buf)

    def gather(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(offset, length)``; each chunk they touch is decoded once."""
        touched = sorted({c for off, ln in ranges for c in self.chunks_of(off, ln)})
        decoded = {c: self._decode(c) for c in touched}
        out = []
        for off, ln in ranges:
            ln = max(0, min(ln, self.size - off))
            parts = []
            at = off
            while at < off + ln:
                c, within = divmod(at, self.chunk_size)
                take = min(off + ln - at, self.chunk_size - within)
                parts.append(decoded[c][within : within + take].tobytes())
                at += take
            out.append(b"".join(parts))
        return out

    def chunks_of(self, offset: int, length: int) -> range:
        """The chunks ``[offset, offset + length)`` touches."""
        end = min(offset + length, self.size)
        if end <= offset:
            return range(0)
        return range(offset // self.chunk_size, (end - 1) // self.chunk_size + 1)

    def chunk(self, c: int) -> np.ndarray:
        """Chunk ``c``'s logical bytes (from the cache, or decoded and checked)."""
        with self._lock:
            hit = self._cache.get(c)
            if hit is not None:
                self._cache.move_to_end(c)
                return hit
        data = self._decode(c)
        with self._lock:
            self._cache[c] = data
            while len(self._cache) > _CACHED:
                self._cache.popitem(last=False)
        return data

    # -- decoding ------------------------------------------------------------------------------
    def _decode(self, c: int, out: np.ndarray | None = None) -> np.ndarray:
        """Chunk ``c`` decoded into ``out`` (its logical length; a new array when None) and
        checked; a chunk that fails its check raises, whatever ``out`` holds then."""
        if not 0 <= c < len(self.index):
            raise IndexError(c)
        e = self.index[c]
        logical = min(self.chunk_size, self.size - c * self.chunk_size)
        stored = self._read(e.length, e.offset)
        if len(stored) != e.length:
            raise self.corrupt(c, "it is cut short")
        if out is None:
            out = np.empty(logical, dtype=np.uint8)
        self._chunks.decode(c, e.kind, memoryview(stored), out, e.xxh3)
        return out


class ChunkDecoder:
    """Decodes one chunk's stored bytes, wherever they are (a container being read, or an
    encoder checking what it made before it is written); ``name`` names the file in errors.
    Thread-safe: each thread has its own zstd context."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._dctx = threading.local()

    def decode(self, c: int, kind: Kind, stored: memoryview, out: np.ndarray, xxh3: int) -> None:
        """Chunk ``c`` (``kind``, ``stored``) decoded into ``out`` (its logical length) and
        checked against ``xxh3``: :class:`CorruptContainer` whatever ``out`` holds then."""
        import zstandard  # the server's: the client imports the tiers without it

        try:
            self._layout(kind, stored, out, c)
        except zstandard.ZstdError as exc:
            raise self.corrupt(c, f"zstd: {exc}") from exc
        if digest(out.data) != xxh3:
            raise self.corrupt(c, "its bytes do not match their checksum")

    def _layout(self, kind: Kind, stored: memoryview, out: np.ndarray, c: int) -> None:
        """Decode the chunk's ``stored`` bytes into ``out`` (its logical length)."""
        src = np.frombuffer(stored, dtype=np.uint8)
        if kind == Kind.RAW:
            if len(src) != len(out):
                raise self.corrupt(c, "a raw chunk has the wrong length")
            out[:] = src
        elif kind == Kind.ZSTD:
            self._frames(stored, out, c)
        else:
            if len(out) % 2:
                raise self.corrupt(c, "a 2-byte chunk has an odd length")
            high = np.empty(len(out) // 2, dtype=np.uint8)
            end = self._frames(stored, high, c)
            if len(src) - end != len(high):
                raise self.corrupt(c, "its low bytes have the wrong length")
            # Re-interleaved as little-endian 16-bit words (high << 8 | low): several times
            # faster in NumPy than two strided byte copies.
            words = out.view(np.dtype("<u2"))
            words[:] = high
            words <<= 8
            words |= src[end:]

    def _frames(self, stored: memoryview, out: np.ndarray, c: int) -> int:
        """Decode the chunk's frames into ``out``; returns where the frames end."""
        sizes, start = read_frame_table(stored, self.name, c)
        n = len(out)
        if len(sizes) != -(-n // FRAME):
            raise self.corrupt(c, "its frame table has the wrong count")
        starts, end = frame_spans(sizes, start)
        dctx = self._decompressor()
        for i, (at, s) in enumerate(zip(starts, sizes, strict=True)):
            want = min(FRAME, n - i * FRAME)
            part = dctx.decompress(stored[at : at + s], max_output_size=want)
            if len(part) != want:
                raise self.corrupt(c, f"frame {i} decodes to {len(part)} bytes, not {want}")
            out[i * FRAME : i * FRAME + want] = np.frombuffer(part, dtype=np.uint8)
        return end

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        import zstandard

        d: zstandard.ZstdDecompressor | None = getattr(self._dctx, "d", None)
        if d is None:
            d = self._dctx.d = zstandard.ZstdDecompressor()
        return d

    def corrupt(self, c: int, why: str) -> CorruptContainer:
        return CorruptContainer(
            f"{self.name}: chunk {c} of the compressed file is damaged: {why}",
            path=self.name,
            chunk=c,
        )
