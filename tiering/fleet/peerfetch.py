"""A receiver's side of a peer read: one piece of one generation from one peer's
``GET /v1/peer/content``, checked against the piece map before anyone may use it.

A peer answers with the piece, or says why not in a way the receiver acts on:

- :class:`StaleGeneration` (409 ``generation_mismatch``): the catalog moved on; the receiver's
  map is stale and it must start over from the current generation, from no one's old bytes;
- :class:`NotHeld` (404 ``not_held``): ask another source;
- :class:`PeerBusy` (429 ``peer_busy``): the peer serves its most uploads; ask another, or it
  again shortly;
- :class:`PeerFailed`: the peer is down, refused the credential, cut the body short or
  answered something else; ask another source (and count it against the peer);
- :class:`~tiering.fleet.pieces.BadPiece`: the bytes arrived but do not match the digest;
  drop them, avoid the peer a while (:class:`~tiering.fleet.pieces.Avoid`), fetch elsewhere.

Loads read peers through :class:`tiering.fleet.peerreader.PeerRanges`, built on these, and
fills of host copies take their pieces through :func:`fetch_piece`
(:mod:`tiering.copies.piecefill`).
"""

from __future__ import annotations

import functools
import http.client
import json
import ssl
from typing import Any
from urllib.parse import urlencode

import urllib3

from tiering.catalog.pieces import PieceDigests
from tiering.closing import Closing
from tiering.errors import Conflict, Unavailable
from tiering.fleet.pieces import piece_span, verify

__all__ = [
    "NotHeld",
    "PeerBusy",
    "PeerFailed",
    "StaleGeneration",
    "fetch_piece",
    "fetch_range",
    "PeerHttp",
]

ROUTE = "/v1/peer/content"
GENERATION_HEADER = "x-tierd-generation"


class PeerFailed(Unavailable):
    """A peer did not give the piece (down, refused, cut short, or an answer of another shape)."""

    code = "peer_failed"


class NotHeld(PeerFailed):
    """The peer holds no verified bytes of that generation."""

    code = "not_held"


class PeerBusy(PeerFailed):
    """The peer serves as many uploads as it will at once."""

    code = "peer_busy"


class StaleGeneration(Conflict):
    """The file is at another generation in the catalog (``current``) than the one asked for."""

    code = "generation_mismatch"

    def __init__(self, message: str, current: int | None) -> None:
        super().__init__(message, generation=current)
        self.current = current


@functools.cache
def _tls() -> ssl.SSLContext:
    # Loading the CA bundle costs tens of milliseconds of CPU; every fill opened a client of
    # its own, so an 8-host distribution on two cores spent seconds here. One per process.
    return ssl.create_default_context()


class PeerHttp(Closing):
    """HTTP for peer reads: a pool of ``connections`` kept open per peer, the process's one TLS
    context (peers on ``https`` are verified as usual), and each body read straight into a
    buffer of its announced length.

    urllib3 (already here under botocore), not httpx: a piece's body arrives through
    ``readinto`` in a few large reads, where httpx's parser hands it over 64 KiB at a time,
    joined at the end. Measured on the 2-core machine, 8 MiB ranges from a local nginx: 1.17 ms
    of CPU a MiB with httpx, 0.3 with this (see :meth:`get`); an 8-host distribution moves
    1 GiB through it, and a host filling from peers serves requests meanwhile."""

    def __init__(self, *, timeout_s: float, connect_s: float, connections: int) -> None:
        self._pool = urllib3.PoolManager(
            num_pools=64,
            maxsize=connections,
            timeout=urllib3.Timeout(connect=connect_s, read=timeout_s),
            retries=False,
            ssl_context=_tls(),
        )

    def get(
        self, url: str, params: dict[str, Any], headers: dict[str, str], length: int
    ) -> tuple[int, dict[str, str], bytes | bytearray]:
        """``GET url?params``: its status, headers and body. A 2xx body of ``length`` bytes is
        read into one buffer; any other is read whole (an error's JSON), at most
        ``length + 1`` bytes of a 2xx of another length (enough to tell it is wrong)."""
        r = self._pool.request(
            "GET",
            f"{url}?{urlencode(params)}",
            headers=headers,
            preload_content=False,
            decode_content=False,
        )
        clean = False  # the body read to its end: the connection may serve the next request
        try:
            got = {k.lower(): v for k, v in r.headers.items()}
            if not 200 <= r.status < 300:
                clean = True  # read through urllib3, which keeps its own account
                return r.status, got, r.read(1 << 20)
            buf = bytearray(length + 1)
            view, n = memoryview(buf), 0
            # urllib3 2's readinto reads into a bytes object of its own and copies that over:
            # with the GIL held, 0.8 ms of CPU a MiB on the 2-core machine (8 MiB ranges from
            # a local nginx; 1.2 through its decoding queue). The http.client response under
            # it (``_fp``, there since urllib3 1) reads from the socket straight into the
            # buffer: 0.3 ms a MiB. Peers send no content coding: nothing to decode.
            src = getattr(r, "_fp", None) or r
            with view:
                while n < len(buf):
                    step = src.readinto(view[n:])
                    if not step:
                        break
                    n += step
            clean = n == length
            return r.status, got, buf[:n] if n != length else _trimmed(buf, length)
        finally:
            if not clean:
                # Read beneath urllib3, which never saw this body end: the connection is
                # closed now rather than kept in the pool mid-response. Measured on the 2-core
                # machine's namespace fleet: kept, a fill whose peer was killed took 15 s
                # instead of 4.5 and the bucket sent 1.2x the model (two runs each).
                r.close()
            r.release_conn()

    def close(self) -> None:
        self._pool.clear()


def _trimmed(buf: bytearray, length: int) -> bytearray:
    del buf[length:]  # the one spare byte, in place: no copy of the piece
    return buf


def fetch_piece(
    client: PeerHttp,
    peer: str,
    token: str,
    path: str,
    pieces: PieceDigests,
    index: int,
) -> bytes | bytearray:
    """Piece ``index`` of ``pieces``' generation of ``path`` from the peer at URL ``peer``,
    verified against its digest (see the module docstring for what is raised)."""
    offset, length = piece_span(index, pieces.size, pieces.piece_size)
    data = fetch_range(
        client, peer, token, path, pieces.generation, offset, length, what=f"piece {index}"
    )
    verify(pieces, index, data)
    return data


def fetch_range(
    client: PeerHttp,
    peer: str,
    token: str,
    path: str,
    generation: int,
    offset: int,
    length: int,
    *,
    what: str = "",
) -> bytes | bytearray:
    """Bytes ``[offset, offset + length)`` of ``generation`` of ``path`` from the peer at URL
    ``peer``, exactly ``length`` of them, as the peer vouches for them (its verified copy):
    unchecked here, for a receiver with no piece map (see the module docstring for what is
    raised)."""
    headers = {"Authorization": f"Bearer {token}"}
    if length:
        headers["Range"] = f"bytes={offset}-{offset + length - 1}"
    params: dict[str, str | int] = {"path": path, "generation": generation}
    try:
        status, got, body = client.get(peer.rstrip("/") + ROUTE, params, headers, length)
    except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as exc:
        # http.client's own: a chunked body cut short, read beneath urllib3 (PeerHttp.get)
        raise PeerFailed(f"peer {peer}: {exc}", peer=peer) from exc
    what = what or f"bytes {offset}+{length}"
    where = f"peer {peer}, {path!r} at generation {generation}, {what}"
    if status == 409:
        current = _error(body).get("generation")
        raise StaleGeneration(
            f"{where}: the file is at generation {current}",
            current if isinstance(current, int) else None,
        )
    if status == 404 and _error(body).get("code") == "not_held":
        raise NotHeld(f"{where}: not held there", peer=peer)
    if status == 429:
        raise PeerBusy(f"{where}: busy", peer=peer)
    want = 206 if length else 200
    if status != want or got.get(GENERATION_HEADER) != str(generation):
        raise PeerFailed(
            f"{where}: answered {status} ({_error(body).get('code', 'no error code')})",
            peer=peer,
            status=status,
        )
    if len(body) != length:
        raise PeerFailed(f"{where}: {len(body)} bytes, not {length}", peer=peer)
    return body


def _error(raw: bytes | bytearray) -> dict[str, object]:
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    err = body.get("error") if isinstance(body, dict) else None
    return err if isinstance(err, dict) else {}
