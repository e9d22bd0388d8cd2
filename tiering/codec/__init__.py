"""tierd's compressed file format: chunked, indexed, bf16/fp16 byte-grouped (issue 29).

Why: a bf16 weight's high byte (sign and most of the exponent) carries under 3 bits of
information, its low byte nearly 8. Grouped apart, the high bytes entropy-coded and the low
bytes kept raw, a bf16 checkpoint stores in about 0.69 of its size, losslessly; zstd on the
interleaved bytes gets about 0.8. Slow tiers then read a third fewer bytes per model byte.

Layout of a container (all integers little-endian)::

    MAGIC (8 bytes: \\x89 T I E R D Z \\n)
    chunk 0 stored bytes | chunk 1 stored bytes | ...   (each starting at a multiple of 16)
    index: one 32-byte entry per chunk (kind u8, 3 pad, stored length u32,
           stored offset u64, xxh3-64 of the chunk's logical bytes u64,
           xxh3-64 of its stored bytes u64)
    footer, 64 bytes: MAGIC, version u16, flags u16, chunk size u32, logical size u64,
           chunk count u64, index offset u64, index length u64, index xxh3-64 u64,
           then the xxh3-64 of those 56 bytes

- The file is split into fixed logical chunks of :data:`CHUNK` (8 MiB, the fleet's piece
  size), so it is written streaming (the index and footer come last) and a range read or a
  gather decodes only the chunks it touches, found from the footer and the index.
- A chunk is stored :class:`Kind` ``RAW``, ``ZSTD`` or ``SPLIT2`` (see there). ``SPLIT2`` is
  for chunks the safetensors header says are bf16/fp16 tensors: wholly (then it is not
  compared), or mostly (the header's chunk, the edge of an f32 tensor: the smaller of SPLIT2
  and ZSTD). The header is parsed as the first bytes stream in. Other files and chunks are
  ZSTD, and any chunk is RAW where its choice would be no smaller.
- Compressed chunks are many independent zstd frames of :data:`FRAME` (64 KiB) input each,
  standard frames with their content size: nvCOMP's batched Zstd decoder can take every frame
  of a range as one batch on the GPU, and ``zstandard`` decodes the same frames on the CPU.
- Every chunk decoded is checked against its digest: a damaged file is an error naming it and
  the chunk (:class:`CorruptContainer`), never wrong bytes. A decoder on the GPU (where the
  logical bytes never reach the host) checks the digest of the stored bytes before it moves
  them instead: the writer published them only after they decoded back to the logical bytes.
- A file under :data:`MIN_SIZE`, or whose first :data:`PROBE` bytes gain under
  :data:`MIN_GAIN`, is not put in a container at all (:class:`Encoder` passes it through).

This room is below the tiers (which store containers) and imports no CUDA library.
"""

from tiering.codec._decode import Container, ReadAt, is_container
from tiering.codec._encode import (
    LEVEL,
    MIN_GAIN,
    MIN_SIZE,
    PROBE,
    Encoder,
    encode_chunk,
    two_byte_spans,
)
from tiering.codec._format import (
    CHUNK,
    FOOTER,
    FRAME,
    HEADER,
    MAGIC,
    CorruptContainer,
    Kind,
    frame_spans,
    read_frame_table,
)

__all__ = [
    "CHUNK",
    "CODEC",
    "FOOTER",
    "FRAME",
    "HEADER",
    "LEVEL",
    "MAGIC",
    "MIN_GAIN",
    "MIN_SIZE",
    "PROBE",
    "Container",
    "CorruptContainer",
    "Encoder",
    "Kind",
    "ReadAt",
    "encode_bytes",
    "encode_chunk",
    "frame_spans",
    "is_container",
    "open_bytes",
    "read_frame_table",
    "two_byte_spans",
]

#: The codec's name where the catalog and the API show it (``None`` there: stored as is).
CODEC = "tierdz1"


def encode_bytes(data: bytes | bytearray | memoryview, *, level: int = LEVEL) -> bytes:
    """``data`` as it would be stored: a container, or ``data`` itself when it gains too
    little (tests, benchmarks; tiers stream through :class:`Encoder`)."""
    out: list[bytes] = []
    enc = Encoder(lambda b: out.append(bytes(b)), level=level)
    view = memoryview(data)
    for i in range(0, len(view), CHUNK):
        enc.write(view[i : i + CHUNK])
    enc.finish()
    return b"".join(out)


def open_bytes(stored: bytes, name: str = "<bytes>") -> Container:
    """A container held in memory, opened for reading."""
    return Container.open(name, lambda n, off: stored[off : off + n], len(stored))
