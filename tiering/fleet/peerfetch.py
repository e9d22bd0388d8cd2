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
import ssl

import httpx

from tiering.catalog.pieces import PieceDigests
from tiering.errors import Conflict, Unavailable
from tiering.fleet.pieces import piece_span, verify

__all__ = [
    "NotHeld",
    "PeerBusy",
    "PeerFailed",
    "StaleGeneration",
    "fetch_piece",
    "fetch_range",
    "peer_client",
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


def peer_client(timeout: httpx.Timeout, connections: int) -> httpx.Client:
    """An HTTP client for peer reads: ``connections`` kept open, the process's one TLS
    context (peers on ``https`` are verified as usual)."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.Client(timeout=timeout, limits=limits, verify=_tls())


def fetch_piece(
    client: httpx.Client,
    peer: str,
    token: str,
    path: str,
    pieces: PieceDigests,
    index: int,
) -> bytes:
    """Piece ``index`` of ``pieces``' generation of ``path`` from the peer at URL ``peer``,
    verified against its digest (see the module docstring for what is raised)."""
    offset, length = piece_span(index, pieces.size, pieces.piece_size)
    data = fetch_range(
        client, peer, token, path, pieces.generation, offset, length, what=f"piece {index}"
    )
    verify(pieces, index, data)
    return data


def fetch_range(
    client: httpx.Client,
    peer: str,
    token: str,
    path: str,
    generation: int,
    offset: int,
    length: int,
    *,
    what: str = "",
) -> bytes:
    """Bytes ``[offset, offset + length)`` of ``generation`` of ``path`` from the peer at URL
    ``peer``, exactly ``length`` of them, as the peer vouches for them (its verified copy):
    unchecked here, for a receiver with no piece map (see the module docstring for what is
    raised)."""
    headers = {"Authorization": f"Bearer {token}"}
    if length:
        headers["Range"] = f"bytes={offset}-{offset + length - 1}"
    params: dict[str, str | int] = {"path": path, "generation": generation}
    try:
        r = client.get(peer.rstrip("/") + ROUTE, params=params, headers=headers)
    except httpx.HTTPError as exc:
        raise PeerFailed(f"peer {peer}: {exc}", peer=peer) from exc
    what = what or f"bytes {offset}+{length}"
    where = f"peer {peer}, {path!r} at generation {generation}, {what}"
    if r.status_code == 409:
        current = _error(r).get("generation")
        raise StaleGeneration(
            f"{where}: the file is at generation {current}",
            current if isinstance(current, int) else None,
        )
    if r.status_code == 404 and _error(r).get("code") == "not_held":
        raise NotHeld(f"{where}: not held there", peer=peer)
    if r.status_code == 429:
        raise PeerBusy(f"{where}: busy", peer=peer)
    want = 206 if length else 200
    if r.status_code != want or r.headers.get(GENERATION_HEADER) != str(generation):
        raise PeerFailed(
            f"{where}: answered {r.status_code} ({_error(r).get('code', 'no error code')})",
            peer=peer,
            status=r.status_code,
        )
    if len(r.content) != length:
        raise PeerFailed(f"{where}: {len(r.content)} bytes, not {length}", peer=peer)
    return r.content


def _error(r: httpx.Response) -> dict[str, object]:
    try:
        body = r.json()
    except ValueError:
        return {}
    err = body.get("error") if isinstance(body, dict) else None
    return err if isinstance(err, dict) else {}
