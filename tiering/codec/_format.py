"""The container's bytes: header, chunk layouts, index and footer (see the package docstring)."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from tiering.errors import IntegrityError

__all__ = [
    "CHUNK",
    "FOOTER",
    "FRAME",
    "HEADER",
    "MAGIC",
    "ALIGN",
    "VERSION",
    "ChunkEntry",
    "CorruptContainer",
    "Footer",
    "Kind",
    "digest",
    "frame_spans",
    "frame_table",
    "pack_index",
    "padding",
    "unpack_index",
]

#: First and last 8 bytes of every container: a non-ASCII lead byte (no text file starts so)
#: and a newline, as PNG's signature does, so a tool that meets the file can tell what it is.
MAGIC = b"\x89TIERDZ\n"
VERSION = 2
#: Every chunk, every frame and a SPLIT2 chunk's low bytes start at a multiple of this many
#: bytes of the file (zero padding between): a GPU decoder moves a chunk's stored bytes to
#: device memory as they are and hands nvCOMP each frame where it lies (it wants its inputs
#: aligned; 16 bytes is enough for every codec it has).
ALIGN = 16
#: Logical bytes per chunk: the fleet's piece size, so a piece is one chunk's decode.
CHUNK = 8 << 20
#: Input bytes per zstd frame: many small independent frames are what a GPU decodes in
#: parallel (nvCOMP's batched Zstd takes one frame per chunk of its batch).
FRAME = 64 << 10
HEADER = len(MAGIC)

# magic, version, flags, chunk size, logical size, chunks, index offset, index length,
# index xxh3-64; then the xxh3-64 of those 56 bytes.
_FOOTER = struct.Struct("<8sHHIQQQQQ")
FOOTER = _FOOTER.size + 8
# kind, 3 pad bytes, stored length, stored offset, xxh3-64 of the logical bytes, xxh3-64 of
# the stored bytes (what a GPU decoder checks on the host before it moves them; the logical
# bytes then exist only in device memory).
_ENTRY = struct.Struct("<B3xIQQQ")
_U32 = struct.Struct("<I")


class Kind(enum.IntEnum):
    """How one chunk is stored.

    - ``RAW``: the logical bytes as they are.
    - ``ZSTD``: a frame table, then zstd frames of :data:`FRAME` logical bytes each.
    - ``SPLIT2``: for a chunk of 2-byte little-endian elements (bf16, fp16) at even offsets.
      A frame table, then zstd frames of :data:`FRAME` bytes each of the *high* bytes (the
      odd offsets: sign and exponent, which carry under 3 bits of information), then the
      *low* bytes raw (mantissa bits: near random, zstd would only spend time on them). Any
      bytes round-trip so; a chunk partly of other bytes (a header) is SPLIT2 only where that
      is smaller than ZSTD.

    A frame table is a u32 frame count then one u32 stored length per frame; frame ``i``
    decodes to ``FRAME`` bytes, the last to what remains. The table, every frame and the low
    bytes start at a multiple of :data:`ALIGN` from the chunk's start (:func:`frame_spans`).
    Every frame is a standard zstd frame with its content size and no checksum, as nvCOMP's
    batched decoder and ``zstandard`` read.
    """

    RAW = 0
    ZSTD = 1
    SPLIT2 = 2


class CorruptContainer(IntegrityError):
    """A container whose footer, index or a chunk fails its checksum or does not parse."""

    code = "corrupt_compressed_file"


def digest(data: bytes | bytearray | memoryview) -> int:
    """The xxh3-64 a chunk's logical bytes (and the index) are checked with."""
    import xxhash  # the server's: the client imports the tiers (and so this room) without it

    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class ChunkEntry:
    """One chunk in the index: how it is stored, where, and the digest of its logical bytes."""

    kind: Kind
    offset: int
    length: int
    xxh3: int
    #: xxh3-64 of the stored bytes ``[offset, offset + length)``.
    stored_xxh3: int = 0


@dataclass(frozen=True)
class Footer:
    """The fixed-size end of a container: where its index is, and the sizes it describes."""

    chunk_size: int
    logical_size: int
    chunks: int
    index_offset: int
    index_length: int
    index_xxh3: int

    def pack(self) -> bytes:
        body = _FOOTER.pack(
            MAGIC,
            VERSION,
            0,
            self.chunk_size,
            self.logical_size,
            self.chunks,
            self.index_offset,
            self.index_length,
            self.index_xxh3,
        )
        return body + digest(body).to_bytes(8, "little")

    @classmethod
    def unpack(cls, raw: bytes | bytearray, name: str) -> Footer:
        """The footer in ``raw`` (the file's last :data:`FOOTER` bytes); raises
        :class:`CorruptContainer` naming ``name`` unless it is a sound one of this version."""
        if len(raw) != FOOTER or digest(raw[:-8]) != int.from_bytes(raw[-8:], "little"):
            raise CorruptContainer(f"{name}: the compressed file's footer is damaged", path=name)
        magic, version, _flags, chunk, size, n, ioff, ilen, ixxh = _FOOTER.unpack(raw[:-8])
        if magic != MAGIC or version != VERSION:
            raise CorruptContainer(
                f"{name}: not a tierd compressed file of version {VERSION}", path=name
            )
        if chunk <= 0 or n != -(-size // chunk):
            raise CorruptContainer(f"{name}: the footer's sizes disagree", path=name)
        return cls(chunk, size, n, ioff, ilen, ixxh)


def pack_index(entries: list[ChunkEntry]) -> bytes:
    return b"".join(_ENTRY.pack(e.kind, e.length, e.offset, e.xxh3, e.stored_xxh3) for e in entries)


def unpack_index(
    raw: bytes | bytearray, footer: Footer, stored_size: int, name: str
) -> list[ChunkEntry]:
    """The index of a container of ``stored_size`` bytes; checked against the footer."""
    if len(raw) != footer.index_length or digest(raw) != footer.index_xxh3:
        raise CorruptContainer(f"{name}: the compressed file's index is damaged", path=name)
    if footer.index_length != footer.chunks * _ENTRY.size:
        raise CorruptContainer(f"{name}: the index has the wrong length", path=name)
    out = []
    for kind, length, offset, xxh, sxxh in _ENTRY.iter_unpack(raw):
        if kind not in Kind.__members__.values() or offset + length > stored_size:
            raise CorruptContainer(f"{name}: the index names a bad chunk", path=name)
        out.append(ChunkEntry(Kind(kind), offset, length, xxh, sxxh))
    return out


def padding(n: int) -> int:
    """Zero bytes after ``n`` bytes up to the next multiple of :data:`ALIGN`."""
    return -n % ALIGN


def frame_table(sizes: list[int]) -> bytes:
    """The table that leads a ZSTD or SPLIT2 chunk: the count, then each frame's length,
    padded to :data:`ALIGN`."""
    table = _U32.pack(len(sizes)) + b"".join(_U32.pack(s) for s in sizes)
    return table + bytes(padding(len(table)))


def frame_spans(sizes: list[int], start: int) -> tuple[list[int], int]:
    """Where each frame of ``sizes`` starts within its chunk, the first at ``start`` (the
    table's aligned end), each at the next multiple of :data:`ALIGN`; and where they end
    (aligned: the low bytes of a SPLIT2 chunk start there)."""
    at, starts = start, []
    for s in sizes:
        starts.append(at)
        at += s + padding(s)
    return starts, at


def read_frame_table(stored: memoryview, name: str, chunk: int) -> tuple[list[int], int]:
    """The frames' lengths and where the first frame starts, from a chunk's stored bytes."""
    try:
        (n,) = _U32.unpack_from(stored, 0)
        end = 4 + 4 * n
        if end > len(stored):
            raise struct.error("frame table runs past the chunk")
        sizes = [s for (s,) in _U32.iter_unpack(stored[4:end])]
        end += padding(end)
    except struct.error as exc:
        raise CorruptContainer(
            f"{name}: chunk {chunk} of the compressed file is damaged ({exc})",
            path=name,
            chunk=chunk,
        ) from exc
    return sizes, end
