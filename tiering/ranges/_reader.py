"""The one interface the data path reads remote bytes through: :class:`RangeReader`.

A source of remote bytes (an object store, and next a peer: another tierd host serving byte
ranges over HTTP) is one subclass. It gives the few operations the data path needs, and
everything else (a promotion's read-ahead, a load's parallel segments, KvikIO's
``RemoteFile``) is written once on top of them:

- identity: :attr:`~RangeReader.size` and the :attr:`~RangeReader.version` every read is
  pinned to (an object's ETag);
- :meth:`~RangeReader.get`: one range into host memory, exactly, retried as the source
  retries, never mixing two versions (:class:`~tiering.errors.FileChanged` instead);
- :meth:`~RangeReader.start` and :meth:`~RangeReader.readinto`: ranges in parallel, on the
  source's own pool of connections;
- optionally :meth:`~RangeReader.url`: a plain HTTP URL that serves any ``Range`` of those
  bytes, so KvikIO's ``RemoteFile`` (:mod:`tiering.ranges._kvikio`) or tierd's own
  connections (:mod:`tiering.ranges._http`) can read them; :meth:`~RangeReader.pins`, the
  headers that pin such a GET to the version opened, and
  :meth:`~RangeReader.check_unchanged` for after a read that could not be pinned.

**A peer source** fits without touching ``tiering.io``
(:class:`tiering.fleet.peerreader.PeerRanges`): its ``get`` is a ranged
``GET /v1/peer/content`` on a peer, for the generation it was opened at, each piece checked
against the catalog's piece digests; it serves no URL (KvikIO could not check the digests),
and its :attr:`source` is ``peer``. Its :class:`~tiering.tiers.Source` returns it from
``Source.ranges``; ``io`` then reads it as it reads an object.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, wait
from typing import Any, ClassVar, Literal, Protocol

__all__ = ["Pending", "RangeReader", "settle"]


class Pending(Protocol):
    """A range being read (a :class:`~concurrent.futures.Future` is one): ``result`` waits
    for it and raises its error; ``cancel`` stops it if it has not started (a range that
    has started still lands, so wait for it before reusing its buffer)."""

    def result(self, timeout: float | None = None) -> Any: ...

    def cancel(self) -> bool: ...


def settle(futures: Sequence[Future[Any]]) -> list[Any]:
    """Results of every future, in order; on a failure the others are cancelled or waited for
    (none may still write into a caller's buffer) and the first error is raised."""
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    failed = next((f for f in futures if f in done and f.exception() is not None), None)
    if failed is not None:
        for f in futures:
            f.cancel()
        wait(futures)
        exc = failed.exception()
        assert exc is not None
        raise exc
    return [f.result() for f in futures]


def flat(buf: memoryview) -> memoryview:
    """``buf`` as flat bytes."""
    return buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")


class RangeReader(abc.ABC):
    """The bytes of one remote file, pinned to one version, read by ranges (see the module).

    ``name`` names the file in messages; ``pool`` runs the reader's parallel ranges (its
    connections); a range longer than ``part_size`` is read as several requests at once.
    """

    #: Whether :meth:`url` hands out a URL that KvikIO's ``RemoteFile`` can open.
    serves_url: ClassVar[bool] = False
    #: Where a load of these bytes says they came from (its ``source``): a bucket's
    #: ``object_store``, ``peer`` for another host of the fleet, or ``storage`` for a
    #: compressed file of a directory tier (decoded as it is read).
    source: ClassVar[Literal["object_store", "peer", "storage"]] = "object_store"
    #: The stored form, where these bytes are decoded as they are read: a compressed file's
    #: :class:`tiering.codec.Container` (a room beside this one, so not named in the type).
    #: A reader into GPU memory moves its stored bytes and decodes them where they land;
    #: None where the bytes are read as they are.
    encoded: Any = None

    def __init__(
        self, name: str, size: int, version: str, *, pool: Executor, part_size: int
    ) -> None:
        self.name = name
        self.size = size
        self.version = version
        self.pool = pool
        self.part_size = part_size

    @abc.abstractmethod
    def get(self, view: memoryview, offset: int) -> None:
        """Fill all of ``view`` with the bytes at ``offset`` (inside the file): one request's
        worth, retried as the source retries. Raises :class:`~tiering.errors.FileChanged`
        when the bytes are no longer the version opened."""

    def start(self, view: memoryview, offset: int) -> Pending:
        """:meth:`get` on the reader's pool: the range is read while the caller goes on."""
        return self.pool.submit(self.get, view, offset)

    def readinto(self, buf: memoryview, offset: int) -> int:
        """Read up to ``len(buf)`` bytes at ``offset``; fewer only at the end of the file.
        A range longer than ``part_size`` goes out as parallel requests, each into its own
        slice of ``buf``."""
        view = flat(memoryview(buf))
        n = max(0, min(len(view), self.size - offset))
        if n == 0:
            return 0
        step = self.part_size
        if n <= step:
            self.get(view[:n], offset)
            return n
        parts = range(0, n, step)
        settle([self.pool.submit(self.get, view[s : min(n, s + step)], offset + s) for s in parts])
        return n

    def url(self, expires_s: int) -> str:
        """A plain HTTP URL that serves any ``Range`` of the bytes opened, valid for
        ``expires_s`` seconds (only where :attr:`serves_url`)."""
        raise NotImplementedError(f"{type(self).__name__} serves no URL")

    def pins(self) -> dict[str, str]:
        """Headers that pin a GET of :meth:`url` to the version opened (an object's
        ``If-Match``): a reader by URL that sends them needs no :meth:`check_unchanged` after.
        Empty where a header cannot pin it (KvikIO sends none in any case)."""
        return {}

    def read_by_url(self, nbytes: int) -> None:  # noqa: B027 - a reader that counts nothing
        """``nbytes`` of these bytes were read through :meth:`url` (KvikIO), not :meth:`get`:
        for a reader that counts what it reads from its origin."""

    def check_unchanged(self) -> None:  # noqa: B027 - a reader whose every read is pinned
        """Raise :class:`~tiering.errors.FileChanged` unless the bytes opened are still
        there: the check after a read (by :meth:`url`) that could not be pinned."""

    def close(self) -> None:  # noqa: B027 - a reader with nothing of its own to release
        """Release what the reader holds of its own (not its pool)."""
