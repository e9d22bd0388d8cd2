"""Ranges of remote bytes: the one interface the data path reads them through.

:class:`RangeReader` is what a source of remote bytes implements (an object store's ranged
GETs in :mod:`tiering.tiers`, a peer tierd host's ``/v1/peer/content`` in
:mod:`tiering.fleet.peerreader`); :class:`KvikioRanges` reads any
reader that serves a URL through KvikIO's ``RemoteFile``, where :class:`KvikioReads` decides
it wins, and :class:`HttpRanges` reads it over tierd's own connections, which receive each
body straight into its destination (:class:`HttpReads`). Tiers hand their reader out as
``Source.ranges``; ``tiering.io`` uses only this room.
"""

from tiering.ranges._http import (
    HttpFailed,
    HttpMode,
    HttpRanges,
    HttpReads,
    HttpUnsupported,
    Sink,
)
from tiering.ranges._kvikio import KvikioFailed, KvikioMode, KvikioRanges, KvikioReads
from tiering.ranges._readahead import Rings, read_ahead
from tiering.ranges._reader import Pending, RangeReader, flat, settle

__all__ = [
    "HttpFailed",
    "HttpMode",
    "HttpRanges",
    "HttpReads",
    "HttpUnsupported",
    "KvikioFailed",
    "KvikioMode",
    "KvikioRanges",
    "KvikioReads",
    "Pending",
    "RangeReader",
    "Rings",
    "Sink",
    "flat",
    "read_ahead",
    "settle",
]
