"""Content checksums: xxh3-128, written as ``xxh3_128:<hex>`` so the algorithm can change."""

from __future__ import annotations

import os

import xxhash

__all__ = ["ALGORITHM", "CHUNK", "Hasher", "hash_fd", "hex_digest"]

ALGORITHM = "xxh3_128"
CHUNK = 1 << 20


class Hasher:
    """An incremental checksum of one byte stream."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def value(self) -> str:
        return f"{ALGORITHM}:{self._h.hexdigest()}"


def hash_fd(fd: int, size: int | None = None) -> str:
    """Checksum of an open file's bytes, read with ``pread`` (the fd offset is untouched)."""
    h = Hasher()
    offset = 0
    while size is None or offset < size:
        want = CHUNK if size is None else min(CHUNK, size - offset)
        chunk = os.pread(fd, want, offset)
        if not chunk:
            break
        h.update(chunk)
        offset += len(chunk)
    return h.value()


def hex_digest(checksum: str) -> str:
    """The hex part of a stored checksum (used as the HTTP ETag)."""
    return checksum.split(":", 1)[-1]
