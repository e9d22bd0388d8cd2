"""The data-path bench's test files and its control of the page cache.

Test files are written with fsync, so their pages are clean and can be dropped for the cold
figures, and live in a temporary directory that is removed afterwards, whatever happens.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tiering.checksum import Hasher
from tiering.io import pagecache

from ._measure import MiB

__all__ = [
    "drop_cache",
    "odirect_read",
    "warm",
    "workdir",
    "write_data",
    "write_random",
    "write_shards",
]


def drop_cache(path: Path) -> float:
    """Evict ``path`` from the page cache; returns the fraction still resident."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        pagecache.drop(fd)
        size = os.fstat(fd).st_size
        # fadvise alone leaves some pages behind on some filesystems; there, as root, drop the
        # host's whole page cache. Only there: it makes every other file on the host cold too
        # (the test suite's bench tests ran beside loads that then read from "storage").
        left = pagecache.residency(fd, 0, size)
        if left > 0.05 and hasattr(os, "geteuid") and os.geteuid() == 0:
            with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            left = pagecache.residency(fd, 0, size)
        return left
    finally:
        os.close(fd)


def write_data(path: Path, size: int) -> None:
    """``size`` bytes of random data (incompressible, so no layer can cheat on it)."""
    block = np.random.default_rng(0).integers(0, 256, size=min(size, 64 * MiB), dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < size:
            n = min(block.size, size - done)
            done += os.pwrite(fd, block.data[:n], done)
        os.fsync(fd)  # clean pages, so that they can be dropped for the cold runs
    finally:
        os.close(fd)


def write_random(path: Path, size: int) -> str:
    """``size`` random bytes at ``path`` (not synced); returns their checksum (tierd's)."""
    h = Hasher()
    with open(path, "wb") as f:
        left = size
        while left:
            block = os.urandom(min(left, 16 * MiB))
            f.write(block)
            h.update(block)
            left -= len(block)
    return h.value()


def write_shards(directory: Path, total: int, shards: int) -> list[Path]:
    """``shards`` safetensors files of ``total`` bytes in all, named like a real checkpoint."""
    from safetensors.numpy import save_file

    paths = []
    per = max(total // shards, 8 * 4096)
    for s in range(shards):
        # Eight tensors per shard, of mixed dtypes, like a real checkpoint shard.
        tensors: dict[str, np.ndarray] = {}
        each = per // 8
        for i in range(8):
            dtype = (np.float32, np.float16, np.int8, np.float32)[i % 4]
            n = max(1, each // np.dtype(dtype).itemsize)
            tensors[f"layers.{s}.w{i}"] = np.full(n, i, dtype=dtype)
        path = directory / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(path))
        del tensors
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        paths.append(path)
    return paths


def odirect_read(path: Path, threads: int, block: int = 16 * MiB) -> None:
    """Read ``path`` with O_DIRECT from ``threads`` threads: what the disk itself gives."""
    size = path.stat().st_size
    chunks = [(o, min(block, size - o)) for o in range(0, size, block)]
    lock = threading.Lock()

    def worker() -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        buf = mmap.mmap(-1, block)  # page aligned, as O_DIRECT needs
        try:
            while True:
                with lock:
                    if not chunks:
                        return
                    off, n = chunks.pop(0)
                aligned = -(-n // 4096) * 4096
                os.preadv(fd, [memoryview(buf)[:aligned]], off)
        finally:
            buf.close()
            os.close(fd)

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def warm(path: Path) -> None:
    """Pull a file back into the page cache (after cold runs dropped it)."""
    buf = bytearray(64 * MiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        while n := os.preadv(fd, [buf], off):
            off += n
    finally:
        os.close(fd)


@contextlib.contextmanager
def workdir(parent: Path | None) -> Iterator[Path]:
    """A fresh directory under ``parent`` (default: the current one), removed on exit.

    Not the system temp directory by default: that is often tmpfs, where nothing is ever cold.
    """
    base = Path(parent) if parent else Path.cwd()
    path = Path(tempfile.mkdtemp(prefix="tierd-bench-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
