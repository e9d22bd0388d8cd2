"""A bucket's listing in relpath order, whatever order the store lists in.

The scan merges every tier's walk with the catalog in relpath order, so a walk out of order
would have it take a file that is there for one that is gone. S3 general-purpose buckets list
in UTF-8 byte order (relpath order), but S3 Express directory buckets and several S3-compatible
stores promise no order. :func:`in_relpath_order` sorts a listing in bounded memory: runs of
:data:`RUN` entries are sorted and spilled to temp files, then merged. Listing a bucket costs a
request per thousand keys; sorting what came back costs far less (about a second of CPU per
million keys), so every listing is sorted rather than trusted.

The whole listing is read before the first entry comes out, so a listing that fails does so
before the scan decides anything about the tier's files.
"""

from __future__ import annotations

import heapq
import pickle
import tempfile
from collections.abc import Iterable, Iterator
from typing import IO

from tiering.tiers._base import WalkEntry

__all__ = ["RUN", "in_relpath_order"]

#: Entries held in memory at once; more spill to temp files in sorted runs (about 200 bytes
#: an entry: 20 MB).
RUN = 100_000


def _relpath(e: WalkEntry) -> str:
    return e.relpath


def _spill(run: list[WalkEntry]) -> IO[bytes]:
    f = tempfile.TemporaryFile(prefix="tierd-listing-")  # noqa: SIM115 (closed by _read)
    pickler = pickle.Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)
    for e in sorted(run, key=_relpath):
        pickler.dump(e)
    f.seek(0)
    return f


def _read(f: IO[bytes]) -> Iterator[WalkEntry]:
    with f:
        unpickler = pickle.Unpickler(f)
        while True:
            try:
                yield unpickler.load()
            except EOFError:
                return


def in_relpath_order(entries: Iterable[WalkEntry], *, run: int = RUN) -> Iterator[WalkEntry]:
    """``entries`` in relpath order, holding at most ``run`` of them in memory (the temp files
    are tierd's own, removed when the walk ends or is dropped)."""
    held: list[WalkEntry] = []
    spilled: list[IO[bytes]] = []
    try:
        for e in entries:
            held.append(e)
            if len(held) >= run:
                spilled.append(_spill(held))
                held = []
        held.sort(key=_relpath)
    except BaseException:
        for f in spilled:
            f.close()
        raise
    if not spilled:
        yield from held
        return
    yield from heapq.merge(*(_read(f) for f in spilled), held, key=_relpath)
