"""The parts of a load request on the client's side: files, the target, the reply's tensors.

A file is a catalog id or a relpath (:func:`file_ref`, :func:`file_refs`). ``device``,
``devices``, ``sharding`` and ``rank`` become one :class:`~tiering.io.target.LoadTarget` here
(the same parser as the server's), which writes the request's fields and says which reply
comes back: one entry per device, or the single-device one. A target the server would refuse
fails here with the server's code and message, before anything is sent or leased.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tiering.errors import InvalidInput
from tiering.io.target import LoadTarget

from ._buffers import Buffer, Tensors
from ._exceptions import InvalidRequest, TierdClientError

__all__ = [
    "drop_none",
    "file_ref",
    "file_refs",
    "model_body",
    "open_tensors",
    "parse_target",
    "safetensors_body",
]


def file_ref(file: int | str) -> dict[str, Any]:
    """The body fields naming one file."""
    if isinstance(file, bool) or not isinstance(file, (int, str)):
        raise TypeError(f"a file is a catalog id (int) or a relpath (str), not {file!r}")
    return {"file_id": file} if isinstance(file, int) else {"path": file}


def file_refs(files: int | str | Sequence[int | str]) -> dict[str, Any]:
    """The body fields naming several files: all by id, or all by relpath."""
    items = [files] if isinstance(files, (int, str)) else list(files)
    if all(isinstance(f, int) and not isinstance(f, bool) for f in items):
        return {"file_ids": items}
    if all(isinstance(f, str) for f in items):
        return {"paths": items}
    raise TypeError("give files all by id or all by relpath")


def drop_none(d: dict[str, Any]) -> dict[str, Any]:
    """A body without the fields left to the server's defaults."""
    return {k: v for k, v in d.items() if v is not None}


def _no_wait(target: LoadTarget) -> dict[str, Any]:
    """``wait: false`` for a load into one GPU: the server replies before its copies of bytes
    held in memory land, and the client waits on the reply's ``ready_event`` once its buffers
    are open (:func:`open_tensors`; :meth:`Tensors.wait`), so opening them overlaps the
    copies."""
    one = not target.many and target.sharding is None and len(target.devices) == 1
    return {"wait": False} if one and target.devices[0].is_cuda else {}


def safetensors_body(
    files: int | str | Sequence[int | str],
    names: Sequence[str] | None,
    target: LoadTarget,
    ttl_s: float | None,
    shared: bool,
) -> dict[str, Any]:
    """The body of ``POST /v1/load/safetensors``."""
    return {**file_refs(files), **model_body(names, None, target, ttl_s, shared)}


def model_body(
    names: Sequence[str] | None,
    prefix: str | None,
    target: LoadTarget,
    ttl_s: float | None,
    shared: bool,
) -> dict[str, Any]:
    """The body of ``POST /v1/models/load`` (less the files, that of a safetensors load)."""
    return drop_none(
        {
            "names": list(names) if names is not None else None,
            "prefix": prefix,
            **target.to_json(),
            "ttl_s": ttl_s,
            "shared": shared or None,
            **_no_wait(target),
        }
    )


def parse_target(
    device: str,
    devices: str | Sequence[str] | None = None,
    sharding: Mapping[str, Any] | None = None,
    rank: int | None = None,
) -> LoadTarget:
    """The target of a call's keywords: ``devices`` (a list, or ``"cuda:*"``) instead of
    ``device`` where given.

    Raises
    ------
    InvalidRequest
        A target the server would refuse (422, with its code).
    """
    try:
        return LoadTarget.parse(
            device=device if devices is None else None,
            devices=devices,
            sharding=sharding,
            rank=rank,
        )
    except InvalidInput as exc:
        raise InvalidRequest(422, exc.code, exc.message, dict(exc.details)) from exc


class _Opener(Protocol):
    def _open_all(self, reply: Mapping[str, Any], wait: bool = True) -> list[Buffer]: ...

    def release(self, buffer_id: str) -> dict[str, Any]: ...


def open_tensors(
    client: _Opener, target: LoadTarget, reply: Mapping[str, Any], wait: bool = True
) -> Tensors | list[Tensors]:
    """The :class:`Tensors` of a safetensors or model load's reply, opened here; a list of
    them, one per device (``.device``, ``.rank``, ``.delivery``), for a ``many`` target. On a
    failure none stays leased. ``wait`` false (one device): the caller calls
    :meth:`Tensors.wait` before the bytes are read."""
    if not target.many:
        return Tensors(client._open_all(reply, wait), reply["tensors"])
    out: list[Tensors] = []
    try:
        for entry in reply["devices"]:
            t = Tensors(client._open_all(entry), entry["tensors"])
            t.device, t.rank, t.delivery = entry["device"], entry["rank"], entry["delivery"]
            out.append(t)
    except BaseException:
        for t in out:
            t.close()
        # _open_all released the entry it failed on; the later ones were never opened.
        for entry in reply["devices"][len(out) + 1 :]:
            for info in entry["buffers"]:
                with contextlib.suppress(TierdClientError):
                    client.release(info["buffer_id"])
        raise
    return out
