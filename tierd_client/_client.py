"""tierd over HTTP: :class:`Client`, one method per REST call.

Errors from httpx are translated here, once, into :class:`TransportError`, and error replies
into the :class:`APIError` tree (:func:`error_from_response`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

import httpx
import numpy as np

from tiering.closing import Closing
from tiering.io.fences import wait_ready

from ._buffers import Buffer, Tensors, prewarm_cuda
from ._exceptions import TierdClientError, TransportError, error_from_response
from ._loads import drop_none, file_ref, open_tensors, parse_target, safetensors_body
from ._models import ModelsMixin
from ._service import FileRef
from ._state_dict import StateDictSource, close_client, load_state_dict
from ._tls import tls_context

if TYPE_CHECKING:
    import torch

__all__ = ["Client", "FileRef"]


class Client(Closing, ModelsMixin):
    """tierd over HTTP.

    Parameters
    ----------
    base_url:
        Where tierd listens, e.g. ``http://127.0.0.1:8470``.
    token:
        A data or admin token (``Authorization: Bearer``); none for an open loopback server.
    timeout:
        Seconds per request.
    transport:
        An httpx transport (tests pass an ASGI one).
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8470",
        token: str | None = None,
        *,
        timeout: float = 120.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=base_url,
            headers=headers,
            timeout=timeout,
            transport=transport,
            verify=tls_context(),
        )
        prewarm_cuda()  # started at import already (see tierd_client): a no-op here
        if transport is None:
            threading.Thread(
                target=_warm, args=(self._http,), name="tierd-client-warm", daemon=True
            ).start()

    # -- plumbing --------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
    ) -> Any:
        """One call; returns the decoded JSON, raises :class:`APIError` for an error reply."""
        try:
            resp = self._http.request(method, path, json=json, params=params)
        except httpx.HTTPError as exc:
            raise TransportError(f"{method} {path}: {exc}") from exc
        if resp.status_code >= 400:
            raise error_from_response(resp)
        return resp.json() if resp.content else None

    def close(self) -> None:
        # Before the connection goes: live state dicts' leases are released over it.
        close_client(self)
        self._http.close()

    def _open(self, info: Mapping[str, Any], release_on_close: bool, wait: bool = True) -> Buffer:
        try:
            return Buffer(self, info, release_on_close=release_on_close, wait=wait)
        except BaseException:
            # The lease is useless to a caller who cannot open it: give it back now.
            with contextlib.suppress(TierdClientError):
                self.release(info["buffer_id"])
            raise

    # -- loads -----------------------------------------------------------------------------

    def _open_all(self, reply: Mapping[str, Any], wait: bool = True) -> list[Buffer]:
        """Every buffer of a reply, opened here, then waited for (its copies may still be
        landing: see ``wait`` of the load's request; ``wait`` false leaves that to the
        caller); on a failure none stays leased (the opened ones are closed and released, the
        rest released unopened)."""
        out: list[Buffer] = []
        try:
            for info in reply["buffers"]:
                out.append(self._open(info, True, wait=False))
            if wait:
                wait_ready(b.info["handle"] for b in out)
        except BaseException:
            for b in out:
                b.close()
            # _open released the one it failed on; the rest were never opened.
            for info in reply["buffers"][len(out) + 1 :]:
                with contextlib.suppress(TierdClientError):
                    self.release(info["buffer_id"])
            raise
        return out

    @overload
    def load(
        self,
        file: FileRef,
        *,
        offset: int = 0,
        length: int | None = None,
        device: str = "cpu",
        dtype: str = "uint8",
        shape: Sequence[int] | None = None,
        ttl_s: float | None = None,
        release_on_close: bool = True,
        shared: bool = False,
        devices: None = None,
    ) -> Buffer: ...

    @overload
    def load(
        self,
        file: FileRef,
        *,
        offset: int = 0,
        length: int | None = None,
        device: str = "cpu",
        dtype: str = "uint8",
        shape: Sequence[int] | None = None,
        ttl_s: float | None = None,
        release_on_close: bool = True,
        shared: bool = False,
        devices: Sequence[str] | str,
    ) -> list[Buffer]: ...

    def load(
        self,
        file: FileRef,
        *,
        offset: int = 0,
        length: int | None = None,
        device: str = "cpu",
        dtype: str = "uint8",
        shape: Sequence[int] | None = None,
        ttl_s: float | None = None,
        release_on_close: bool = True,
        shared: bool = False,
        devices: Sequence[str] | str | None = None,
    ) -> Buffer | list[Buffer]:
        """Load a file (by id or relpath) or a byte range of it into a buffer on ``device``.

        ``devices`` (``["cuda:0", "cuda:1"]``, or ``"cuda:*"``) instead of ``device``: the
        same bytes on each, one buffer per device, in order (``info["delivery"]`` says how
        each device got them); storage is read once.

        ``shared=True`` promises never to write the buffer. In return the service hands out
        a copy already resident on ``device`` (another process's shared load, a GPU
        prefetch) without reading or allocating anything: N processes share one copy. The
        buffer is then ``read_only`` (see :class:`Buffer` for what refuses writes).
        """
        target = parse_target(device, devices)
        body = drop_none(
            {
                **file_ref(file),
                "offset": offset,
                "length": length,
                **target.to_json(),
                "dtype": dtype,
                "shape": list(shape) if shape is not None else None,
                "ttl_s": ttl_s,
                "shared": shared or None,
            }
        )
        reply = self.request("POST", "/v1/load", json=body)
        if target.many:
            return self._open_all(reply)
        return self._open(reply, release_on_close)

    def load_batch(
        self,
        items: Sequence[FileRef | Mapping[str, Any]],
        *,
        device: str = "cpu",
        ttl_s: float | None = None,
        shared: bool = False,
    ) -> list[Buffer]:
        """Load many files or ranges at once, all or nothing.

        Each item is a file (id or relpath) or a dict with ``file`` and any of ``offset``,
        ``length``, ``dtype``, ``shape`` and ``device``. ``shared`` applies to all of them
        (see :meth:`load`).
        """
        wire = []
        for it in items:
            if isinstance(it, Mapping):
                extra = {k: v for k, v in it.items() if k != "file"}
                wire.append({**file_ref(it["file"]), **drop_none(extra)})
            else:
                wire.append(file_ref(it))
        body = drop_none(
            {"items": wire, "device": device, "ttl_s": ttl_s, "shared": shared or None}
        )
        return self._open_all(self.request("POST", "/v1/load/batch", json=body))

    @overload
    def load_safetensors(
        self,
        files: FileRef | Sequence[FileRef],
        *,
        names: Sequence[str] | None = None,
        device: str = "cpu",
        ttl_s: float | None = None,
        shared: bool = False,
        devices: None = None,
        sharding: None = None,
        rank: None = None,
    ) -> Tensors: ...

    @overload
    def load_safetensors(
        self,
        files: FileRef | Sequence[FileRef],
        *,
        names: Sequence[str] | None = None,
        device: str = "cpu",
        ttl_s: float | None = None,
        shared: bool = False,
        devices: Sequence[str] | str,
        sharding: Mapping[str, Any] | None = None,
        rank: int | None = None,
    ) -> list[Tensors]: ...

    @overload
    def load_safetensors(
        self,
        files: FileRef | Sequence[FileRef],
        *,
        names: Sequence[str] | None = None,
        device: str = "cpu",
        ttl_s: float | None = None,
        shared: bool = False,
        devices: Sequence[str] | str | None = None,
        sharding: Mapping[str, Any],
        rank: int | None = None,
    ) -> list[Tensors]: ...

    def load_safetensors(
        self,
        files: FileRef | Sequence[FileRef],
        *,
        names: Sequence[str] | None = None,
        device: str = "cpu",
        ttl_s: float | None = None,
        shared: bool = False,
        devices: Sequence[str] | str | None = None,
        sharding: Mapping[str, Any] | None = None,
        rank: int | None = None,
    ) -> Tensors | list[Tensors]:
        """Load the tensors (all, or ``names``) of safetensors shards (``shared``: see
        :meth:`load`).

        With ``devices`` (``["cuda:0", "cuda:1"]``, or ``"cuda:*"``) or ``sharding``, returns
        one :class:`Tensors` per device, in order (``.device``, ``.rank``, ``.delivery``):
        without ``sharding`` each gets every tensor (storage read once); with a
        tensor-parallel spec (``{"world_size": 2, "rules": [{"pattern": "*.q_proj.weight",
        "dim": 0}]}``) each rank's device gets its slices (``full_shapes`` and
        ``slice_offsets`` say where each lies in the whole tensor). ``rank=k`` loads that
        rank only, into ``device`` (or the one of ``devices``).
        """
        target = parse_target(device, devices, sharding, rank)
        body = safetensors_body(files, names, target, ttl_s, shared)
        return open_tensors(self, target, self.request("POST", "/v1/load/safetensors", json=body))

    def load_state_dict(
        self,
        model: StateDictSource,
        *,
        device: str = "cpu",
        names: Sequence[str] | None = None,
        prefix: str | None = None,
        ttl_s: float | None = None,
        shared: bool = False,
    ) -> dict[str, torch.Tensor]:
        """A model's tensors (all, ``names``, or those starting with ``prefix``) as
        ``{name: torch.Tensor}`` on ``device``: exact dtypes, no copy (views of the leases).

        ``model`` is a model name (:meth:`load_model`), or safetensors files: a relpath ending
        in ``.safetensors``, a catalog id, or a list of them (:meth:`load_safetensors`).

        The leases live as long as the tensors do: a thread renews them at a third of their
        TTL while any tensor (or a view or ``nn.Parameter`` made from one) is alive, and
        releases them once the last is collected. Keep the client open while the tensors are
        in use; :meth:`close` releases what is left (on ``cuda`` the service may then reuse
        the memory). Build a model on them with ``model.load_state_dict(sd, assign=True)``.

        ``shared=True`` (inference weights: never written) shares one resident copy of each
        shard between processes; see :meth:`load`.
        """
        return load_state_dict(
            self, model, device=device, names=names, prefix=prefix, ttl_s=ttl_s, shared=shared
        )

    @overload
    def gather(
        self,
        file: FileRef,
        *,
        dim: int,
        dtype: str = "float32",
        indices: Sequence[int] | np.ndarray | None = None,
        start: int | None = None,
        count: int | None = None,
        device: str = "cpu",
        ttl_s: float | None = None,
        devices: None = None,
    ) -> Buffer: ...

    @overload
    def gather(
        self,
        file: FileRef,
        *,
        dim: int,
        dtype: str = "float32",
        indices: Sequence[int] | np.ndarray | None = None,
        start: int | None = None,
        count: int | None = None,
        device: str = "cpu",
        ttl_s: float | None = None,
        devices: Sequence[str] | str,
    ) -> list[Buffer]: ...

    def gather(
        self,
        file: FileRef,
        *,
        dim: int,
        dtype: str = "float32",
        indices: Sequence[int] | np.ndarray | None = None,
        start: int | None = None,
        count: int | None = None,
        device: str = "cpu",
        ttl_s: float | None = None,
        devices: Sequence[str] | str | None = None,
    ) -> Buffer | list[Buffer]:
        """Rows of a row-major ``(rows, dim)`` matrix file: by ``indices``, or ``start`` and
        ``count``. The buffer's shape is ``(n, dim)``. ``devices`` instead of ``device``: the
        rows on each, one buffer per device (see :meth:`load`)."""
        target = parse_target(device, devices)
        idx = None
        if indices is not None:
            idx = np.asarray(indices).reshape(-1).tolist()
        body = drop_none(
            {
                **file_ref(file),
                "dim": dim,
                "dtype": dtype,
                "indices": idx,
                "start": start,
                "count": count,
                **target.to_json(),
                "ttl_s": ttl_s,
            }
        )
        reply = self.request("POST", "/v1/vectors/gather", json=body)
        if target.many:
            return self._open_all(reply)
        return self._open(reply, True)

    def open_buffer(self, buffer_id: str, *, release_on_close: bool = True) -> Buffer:
        """Open an existing lease (e.g. one a ``gpu`` prefetch keeps warm)."""
        return self._open(self.request("GET", f"/v1/buffers/{buffer_id}"), release_on_close)


def _warm(http: httpx.Client) -> None:
    """One ``GET /healthz`` on a thread at the client's creation, so that an engine's first
    load does not pay what a process's first request costs: the connection (name lookup,
    TCP, TLS), and httpx's and the standard library's first-use imports and regular
    expressions (about 5 ms of a fresh process's first load on the H200 host, measured with
    cProfile). An engine creates its client, builds its model, then loads: this runs under
    the build, and the connection stays in the pool for the load. Any failure is the load's
    to report."""
    with contextlib.suppress(Exception):
        http.get("/healthz")
