"""The streaming encoder: logical bytes in, a container (or the bytes as they are) out."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from tiering.codec._decode import ChunkDecoder
from tiering.codec._format import (
    CHUNK,
    FRAME,
    HEADER,
    MAGIC,
    ChunkEntry,
    Footer,
    Kind,
    digest,
    frame_table,
    pack_index,
    padding,
)

if TYPE_CHECKING:
    # The server's: the client imports the tiers (and so this room) without it.
    import zstandard

__all__ = ["LEVEL", "MIN_GAIN", "MIN_SIZE", "PROBE", "Encoder", "encode_chunk", "two_byte_spans"]

#: zstd level of every frame. Measured on Normal(0, 0.02) bf16 (``tierd bench codec``): level
#: 3 stores the high bytes no smaller than level 1 (their entropy, not the match finder,
#: bounds them) and encodes slower, so 1.
LEVEL = 1
#: A file is kept as it is unless the container saves at least this share of its bytes.
MIN_GAIN = 0.05
#: Files smaller than this are kept as they are: a few KiB saved on a slow tier is no time
#: saved (small reads are latency-bound), and the container's index costs a read.
MIN_SIZE = 1 << 20
#: The encoder decides from the first bytes of a file (held in memory) whether the file is
#: worth a container; from then on it streams a chunk at a time.
PROBE = 4 * CHUNK

# safetensors dtypes whose elements are 2 bytes little-endian floats: their high bytes are
# sign and exponent, which is what byte grouping exploits.
_TWO_BYTE = {"BF16", "F16"}
_MAX_HEADER = 100_000_000


def two_byte_spans(head: bytes | bytearray) -> list[tuple[int, int]]:
    """Absolute ``[begin, end)`` byte spans of the bf16/fp16 tensors of a safetensors file
    whose first bytes are ``head`` (merged, even-aligned ones only), or ``[]`` when ``head``
    is no safetensors header it holds whole.

    A wrong guess costs only ratio, never bytes (every chunk kind is lossless for any bytes),
    so this parses leniently rather than validating as :mod:`tiering.io.safetensors` does.
    """
    if len(head) < 8:
        return []
    n = int.from_bytes(head[:8], "little")
    if n > _MAX_HEADER or 8 + n > len(head):
        return []
    try:
        doc = json.loads(bytes(head[8 : 8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return []
    if not isinstance(doc, dict):
        return []
    spans = []
    for entry in doc.values():
        if not isinstance(entry, dict) or entry.get("dtype") not in _TWO_BYTE:
            continue
        offs = entry.get("data_offsets")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
            continue
        begin, end = 8 + n + offs[0], 8 + n + offs[1]
        if 0 <= begin < end and begin % 2 == 0 and end % 2 == 0:
            spans.append((begin, end))
    spans.sort()
    merged: list[tuple[int, int]] = []
    for b, e in spans:
        if merged and b <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((b, e))
    return merged


def _covered(spans: list[tuple[int, int]], begin: int, end: int) -> int:
    """How many bytes of ``[begin, end)`` the spans hold."""
    return sum(max(0, min(e, end) - max(b, begin)) for b, e in spans)


def _frames(cctx: zstandard.ZstdCompressor, data: memoryview) -> tuple[list[bytes], list[int]]:
    """The frames of ``data``, each followed by its padding (see ``frame_spans``), and their
    unpadded lengths."""
    frames = [cctx.compress(data[i : i + FRAME]) for i in range(0, len(data), FRAME)]
    return [f + bytes(padding(len(f))) for f in frames], [len(f) for f in frames]


def _split2(cctx: zstandard.ZstdCompressor, data: memoryview) -> list[bytes]:
    arr = np.frombuffer(data, dtype=np.uint8)
    frames, sizes = _frames(cctx, np.ascontiguousarray(arr[1::2]).data)
    return [frame_table(sizes), *frames, np.ascontiguousarray(arr[0::2]).tobytes()]


def _zstd(cctx: zstandard.ZstdCompressor, data: memoryview) -> list[bytes]:
    frames, sizes = _frames(cctx, data)
    return [frame_table(sizes), *frames]


def encode_chunk(
    cctx: zstandard.ZstdCompressor, data: memoryview, two_byte: int
) -> tuple[Kind, list[bytes]]:
    """One chunk's kind and stored bytes (as parts), given how many of its bytes are 2-byte
    elements: SPLIT2 for a chunk wholly of them; for one mostly of them (the header's chunk,
    the edge of another dtype's tensor) SPLIT2 or ZSTD, whichever is smaller; else ZSTD.
    RAW whenever the choice is no smaller than the bytes."""
    candidates: list[tuple[Kind, list[bytes]]] = []
    if 2 * two_byte >= len(data):
        candidates.append((Kind.SPLIT2, _split2(cctx, data)))
    if two_byte < len(data):
        candidates.append((Kind.ZSTD, _zstd(cctx, data)))
    kind, parts = min(candidates, key=lambda kp: sum(len(p) for p in kp[1]))
    if sum(len(p) for p in parts) >= len(data):
        return Kind.RAW, [bytes(data)]
    return kind, parts


class Encoder:
    """Encodes one file streaming: :meth:`write` its bytes in order, then :meth:`finish`.

    The output goes to ``sink`` as it is made: either a container, or (when the file is under
    :data:`MIN_SIZE`, or its first :data:`PROBE` bytes gain under :data:`MIN_GAIN`) the bytes
    unchanged; :attr:`compressed` says which, once decided. Memory is bounded by the probe.
    """

    def __init__(
        self,
        sink: Callable[[bytes | memoryview], None],
        *,
        level: int = LEVEL,
        verify: str | None = None,
    ) -> None:
        import zstandard

        self._sink = sink
        # With ``verify`` (the file's name), each chunk is decoded again as soon as it is
        # encoded and checked against its input, before any of it reaches the sink: for a
        # sink whose bytes cannot be read back before they are published (a multipart
        # upload's parts), this is the decode-before-commit check.
        self._check = ChunkDecoder(verify) if verify is not None else None
        self._cctx = zstandard.ZstdCompressor(level=level)
        self._buf = bytearray()
        self._spans: list[tuple[int, int]] = []
        self._entries: list[ChunkEntry] = []
        self._held: list[tuple[Kind, list[bytes], int, int]] = []  # chunks encoded in the probe
        self.logical = 0  # bytes taken
        self.stored = 0  # bytes given to the sink
        self.compressed: bool | None = None  # None until decided

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.logical += len(data)
        if self.compressed is False:
            self._emit(data)
            return
        self._buf += data
        if self.compressed is None and len(self._buf) >= PROBE:
            self._decide(final=False)
        if self.compressed:
            self._drain(final=False)

    def finish(self) -> None:
        """Flush the rest: the last chunk, the index and the footer."""
        if self.compressed is None:
            self._decide(final=True)
        if not self.compressed:
            return
        self._drain(final=True)
        index = pack_index(self._entries)
        footer = Footer(
            CHUNK, self.logical, len(self._entries), self.stored, len(index), digest(index)
        )
        self._emit(index)
        self._emit(footer.pack())

    def _emit(self, data: bytes | bytearray | memoryview) -> None:
        if data:
            self._sink(memoryview(data) if isinstance(data, bytearray) else data)
            self.stored += len(data)

    def _chunk(self, start: int, data: memoryview) -> tuple[Kind, list[bytes]]:
        return encode_chunk(self._cctx, data, _covered(self._spans, start, start + len(data)))

    def _decide(self, *, final: bool) -> None:
        """Encode the probe's whole chunks; keep the file raw unless they gain enough.

        A file that itself starts with :data:`MAGIC` always goes in a container, so that a
        stored file starting with it is one (readers tell the two kinds apart so).
        """
        self._spans = two_byte_spans(self._buf)
        wrap = self._buf[:HEADER] == MAGIC
        if final and len(self._buf) < MIN_SIZE and not wrap:
            self.compressed = False
        else:
            whole = len(self._buf) if final else len(self._buf) // CHUNK * CHUNK
            for start in range(0, whole, CHUNK):
                data = memoryview(bytes(self._buf[start : start + CHUNK]))
                kind, parts = self._chunk(start, data)
                self._held.append((kind, parts, digest(data), len(data)))
            stored = sum(len(p) for _, parts, _, _ in self._held for p in parts)
            self.compressed = wrap or stored <= (1 - MIN_GAIN) * whole
            if self.compressed:
                del self._buf[:whole]
        if not self.compressed:
            self._held.clear()
            raw, self._buf = self._buf, bytearray()
            self._emit(raw)
            return
        self._emit(MAGIC)
        for kind, parts, xxh, length in self._held:
            self._put(kind, parts, xxh, length)
        self._held.clear()

    def _put(self, kind: Kind, parts: list[bytes], xxh: int, length: int) -> None:
        import xxhash

        if self._check is not None and kind != Kind.RAW:
            out = np.empty(length, dtype=np.uint8)
            self._check.decode(len(self._entries), kind, memoryview(b"".join(parts)), out, xxh)

        self._emit(bytes(padding(self.stored)))  # every chunk starts aligned
        offset = self.stored
        stored = xxhash.xxh3_64()
        for p in parts:
            stored.update(p)
            self._emit(p)
        entry = ChunkEntry(kind, offset, self.stored - offset, xxh, stored.intdigest())
        self._entries.append(entry)

    def _drain(self, *, final: bool) -> None:
        """Encode the whole chunks buffered (and with ``final``, the rest)."""
        # Each chunk is copied out of the buffer (a memcpy, next to zstd's cost) so that no
        # view pins the buffer when it is shrunk.
        start = len(self._entries) * CHUNK
        done = 0
        while len(self._buf) - done >= CHUNK or (final and done < len(self._buf)):
            data = memoryview(bytes(self._buf[done : done + CHUNK]))
            kind, parts = self._chunk(start + done, data)
            self._put(kind, parts, digest(data), len(data))
            done += len(data)
        del self._buf[:done]
