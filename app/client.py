"""Python SDK of tierd: REST calls, and buffers opened in the caller's process as arrays.

>>> from app.client import Client
>>> with Client("http://127.0.0.1:8470", token) as tierd:             # doctest: +SKIP
...     with tierd.load("models/llama/shard-0.bin", device="cuda:0") as buf:
...         t = torch.from_dlpack(buf)      # zero copy: the service's GPU allocation
...     with tierd.load("ids.bin", dtype="int64") as buf:
...         a = numpy.asarray(buf)          # zero copy: the service's shared memory

A loaded :class:`Buffer` holds a lease. Closing it (or leaving its ``with`` block) releases
the lease; the mapping itself closes once no array made from it (a tensor, say) is alive, so
such an array never points at unmapped memory. Renew long-lived buffers before ``expires_at``
(:meth:`Buffer.renew`), or the service frees them.

Errors are exceptions carrying the server's code and message::

    TierdClientError
    ├── TransportError            the server could not be reached (connection, timeout)
    ├── JobFailed                 a prefetch waited on with wait=True ended failed
    └── APIError                  the server answered with an error: status, code, message
        ├── InvalidRequest        400, 422: bad input (unknown device, dtype, shape, index)
        ├── RangeNotSatisfiable   416: a range outside the file
        ├── AuthError             401, 403
        ├── NotFound              404: no such file, buffer or job
        ├── Conflict              409
        ├── TooLarge              413: e.g. an index list over the server's limit
        ├── TooManyRequests       429
        ├── InsufficientSpace     507: over a device's lease budget (details say what is free)
        ├── Unavailable           503
        └── ServerError           any other 5xx
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx
import numpy as np

from tiering.io.buffers import Attached, attach
from tiering.io.safetensors import DTYPES

__all__ = [
    "APIError",
    "AuthError",
    "Buffer",
    "Client",
    "Conflict",
    "InsufficientSpace",
    "InvalidRequest",
    "JobFailed",
    "NotFound",
    "RangeNotSatisfiable",
    "ServerError",
    "Tensors",
    "TierdClientError",
    "TooLarge",
    "TooManyRequests",
    "TransportError",
    "Unavailable",
]

FileRef = int | str
"""A catalog file id, or a relpath."""


# -- errors ----------------------------------------------------------------------------------
class TierdClientError(Exception):
    """Base of every error the client raises."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class TransportError(TierdClientError):
    """The server could not be reached, or did not answer in time."""


class JobFailed(TierdClientError):
    """A job waited on ended ``failed``; ``job`` is its final state."""

    def __init__(self, message: str, job: dict[str, Any]) -> None:
        super().__init__(message)
        self.job = job


class APIError(TierdClientError):
    """The server answered with an error.

    Attributes
    ----------
    status:
        HTTP status.
    code:
        The server's snake_case error code (``invalid_range``, ``insufficient_space``...).
    details:
        The error's other fields (sizes, limits, ids), e.g. ``free`` for a 507.
    """

    def __init__(self, status: int, code: str, message: str, details: dict[str, Any]) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.details = details

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"


class InvalidRequest(APIError):
    pass


class RangeNotSatisfiable(APIError):
    pass


class AuthError(APIError):
    pass


class NotFound(APIError):
    pass


class Conflict(APIError):
    pass


class TooLarge(APIError):
    pass


class TooManyRequests(APIError):
    pass


class InsufficientSpace(APIError):
    pass


class Unavailable(APIError):
    pass


class ServerError(APIError):
    pass


_BY_STATUS: dict[int, type[APIError]] = {
    400: InvalidRequest,
    401: AuthError,
    403: AuthError,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    416: RangeNotSatisfiable,
    422: InvalidRequest,
    429: TooManyRequests,
    503: Unavailable,
    507: InsufficientSpace,
}


def _error(resp: httpx.Response) -> APIError:
    """The one place where an error reply becomes an exception."""
    try:
        body = resp.json()["error"]
        code, message = str(body.pop("code")), str(body.pop("message"))
        details = dict(body)
    except Exception:
        code, message, details = "http_error", resp.text[:500] or resp.reason_phrase, {}
    cls = _BY_STATUS.get(resp.status_code)
    if cls is None:
        cls = ServerError if resp.status_code >= 500 else APIError
    return cls(resp.status_code, code, message, details)


# -- buffers ---------------------------------------------------------------------------------
class Buffer:
    """A leased buffer opened in this process.

    ``cuda`` buffers expose ``__cuda_array_interface__``, ``__dlpack__`` and
    ``__dlpack_device__`` (``torch.from_dlpack``, ``cupy.from_dlpack``, ``cupy.asarray``);
    ``cpu`` buffers expose the buffer protocol (Python 3.12+), ``__array_interface__`` and
    ``__dlpack__`` (``numpy.asarray``, ``memoryview``, ``torch.from_dlpack``). None copies.

    Attributes
    ----------
    id, nbytes, device, dtype, shape, expires_at:
        From the lease; ``info`` is the whole lease as the server sent it.
    """

    def __init__(
        self, client: Client | None, info: Mapping[str, Any], *, release_on_close: bool = True
    ) -> None:
        self.info = dict(info)
        self.id: str = info["buffer_id"]
        self.nbytes: int = int(info["nbytes"])
        self.device: str = info["device"]
        self.dtype: str = info["dtype"]
        self.shape: tuple[int, ...] = tuple(info["shape"])
        self.expires_at: str = info["expires_at"]
        self._client = client
        self._release_on_close = release_on_close
        self._attached: Attached | None = attach(info["handle"], self.nbytes)
        flat = self._attached.array
        # Kept even after close(): arrays made through __array_interface__ or
        # __cuda_array_interface__ hold this object, not the array, and must stay mapped.
        self._array: Any = flat.view(np.dtype(self.dtype)).reshape(self.shape)
        self._closed = False

    @property
    def array(self) -> Any:
        """The data as a CuPy (``cuda``) or NumPy (``cpu``) array of ``dtype`` and ``shape``."""
        if self._closed:
            raise TierdClientError(f"buffer {self.id} is closed")
        return self._array

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def view(self, offset: int, nbytes: int, dtype: Any, shape: Sequence[int]) -> Any:
        """An array over ``nbytes`` at byte ``offset`` of the buffer (for packed tensors)."""
        if self._attached is None:
            raise TierdClientError(f"buffer {self.id} is closed")
        flat = self._attached.array[offset : offset + nbytes]
        return flat.view(np.dtype(dtype)).reshape(tuple(shape))

    # -- interchange protocols -----------------------------------------------------------
    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        dev = self.array.__dlpack_device__()
        return int(dev[0]), int(dev[1])

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if not self.is_cuda:
            raise AttributeError("__cuda_array_interface__: this buffer is in host memory")
        cai: dict[str, Any] = self.array.__cuda_array_interface__
        return cai

    @property
    def __array_interface__(self) -> dict[str, Any]:
        if self.is_cuda:
            raise AttributeError("__array_interface__: this buffer is in GPU memory")
        ai: dict[str, Any] = self.array.__array_interface__
        return ai

    def __buffer__(self, flags: int) -> memoryview:
        if self.is_cuda:
            raise TypeError("a GPU buffer has no buffer protocol; use __dlpack__")
        return memoryview(self.array)

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    # -- lease -----------------------------------------------------------------------------
    def renew(self, ttl_s: float | None = None) -> None:
        """Restart the lease's TTL (``ttl_s``, default the lease's own)."""
        if self._client is None:
            raise TierdClientError("this buffer has no client to renew it with")
        info = self._client.renew(self.id, ttl_s)
        self.expires_at = info["expires_at"]

    def close(self, release: bool | None = None) -> None:
        """Close the buffer and (by default) release the lease. Idempotent.

        The mapping itself closes once neither this object nor any array made from it is
        alive, so a tensor that still views the memory never faults.
        """
        if self._closed:
            return
        self._closed = True
        attached, self._attached = self._attached, None
        if attached is not None:
            attached.close()
        release = self._release_on_close if release is None else release
        if release and self._client is not None:
            with contextlib.suppress(NotFound):  # expired already: nothing to give back
                self._client.release(self.id)

    def __enter__(self) -> Buffer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"<Buffer {self.id} {self.device} {self.dtype}{list(self.shape)} "
            f"{self.nbytes} bytes {state}>"
        )


class Tensors(Mapping[str, Any]):
    """Tensors of a safetensors load: ``{name: array}`` over the shards' buffers.

    Arrays are CuPy or NumPy views in the storage dtype: BF16 and F8 tensors come as their raw
    bits (``uint16``/``uint8``); ``dtypes`` has every tensor's safetensors dtype, and
    :meth:`torch` gives torch tensors with the exact dtypes, still without a copy.
    """

    def __init__(self, buffers: list[Buffer], layout: Mapping[str, Mapping[str, Any]]) -> None:
        self.buffers = buffers
        by_id = {b.id: b for b in buffers}
        self.dtypes: dict[str, str] = {}
        self._arrays: dict[str, Any] = {}
        for name, t in layout.items():
            buf = by_id[t["buffer_id"]]
            self.dtypes[name] = t["dtype"]
            storage = DTYPES[t["dtype"]].storage
            self._arrays[name] = buf.view(int(t["offset"]), int(t["nbytes"]), storage, t["shape"])

    def __getitem__(self, name: str) -> Any:
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def torch(self) -> dict[str, Any]:
        """``{name: torch.Tensor}`` with torch's exact dtypes (bfloat16, float8...)."""
        import torch

        out = {}
        for name, arr in self._arrays.items():
            t = torch.from_dlpack(arr)
            exact = DTYPES[self.dtypes[name]].exact
            out[name] = t.view(getattr(torch, exact)) if exact else t
        return out

    def close(self, release: bool | None = None) -> None:
        """Close every shard's buffer (and release the leases, by default)."""
        self._arrays.clear()
        for b in self.buffers:
            b.close(release)

    def __enter__(self) -> Tensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the client ------------------------------------------------------------------------------
def _ref(file: FileRef) -> dict[str, Any]:
    if isinstance(file, bool) or not isinstance(file, (int, str)):
        raise TypeError(f"a file is a catalog id (int) or a relpath (str), not {file!r}")
    return {"file_id": file} if isinstance(file, int) else {"path": file}


def _refs(files: FileRef | Sequence[FileRef]) -> dict[str, Any]:
    items = [files] if isinstance(files, (int, str)) else list(files)
    if all(isinstance(f, int) and not isinstance(f, bool) for f in items):
        return {"file_ids": items}
    if all(isinstance(f, str) for f in items):
        return {"paths": items}
    raise TypeError("give files all by id or all by relpath")


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


class Client:
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
            base_url=base_url, headers=headers, timeout=timeout, transport=transport
        )

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
            raise _error(resp)
        return resp.json() if resp.content else None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, info: Mapping[str, Any], release_on_close: bool) -> Buffer:
        try:
            return Buffer(self, info, release_on_close=release_on_close)
        except BaseException:
            # The lease is useless to a caller who cannot open it: give it back now.
            with contextlib.suppress(TierdClientError):
                self.release(info["buffer_id"])
            raise

    # -- loads -----------------------------------------------------------------------------
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
    ) -> Buffer:
        """Load a file (by id or relpath) or a byte range of it into a buffer on ``device``."""
        body = _drop_none(
            {
                **_ref(file),
                "offset": offset,
                "length": length,
                "device": device,
                "dtype": dtype,
                "shape": list(shape) if shape is not None else None,
                "ttl_s": ttl_s,
            }
        )
        return self._open(self.request("POST", "/v1/load", json=body), release_on_close)

    def load_batch(
        self,
        items: Sequence[FileRef | Mapping[str, Any]],
        *,
        device: str = "cpu",
        ttl_s: float | None = None,
    ) -> list[Buffer]:
        """Load many files or ranges at once, all or nothing.

        Each item is a file (id or relpath) or a dict with ``file`` and any of ``offset``,
        ``length``, ``dtype``, ``shape`` and ``device``.
        """
        wire = []
        for it in items:
            if isinstance(it, Mapping):
                extra = {k: v for k, v in it.items() if k != "file"}
                wire.append({**_ref(it["file"]), **_drop_none(extra)})
            else:
                wire.append(_ref(it))
        body = _drop_none({"items": wire, "device": device, "ttl_s": ttl_s})
        reply = self.request("POST", "/v1/load/batch", json=body)
        out: list[Buffer] = []
        try:
            for info in reply["buffers"]:
                out.append(self._open(info, True))
        except BaseException:
            for b in out:
                b.close()
            for info in reply["buffers"][len(out) + 1 :]:
                self.release(info["buffer_id"])
            raise
        return out

    def load_safetensors(
        self,
        files: FileRef | Sequence[FileRef],
        *,
        names: Sequence[str] | None = None,
        device: str = "cpu",
        ttl_s: float | None = None,
    ) -> Tensors:
        """Load the tensors (all, or ``names``) of safetensors shards."""
        body = _drop_none(
            {
                **_refs(files),
                "names": list(names) if names is not None else None,
                "device": device,
                "ttl_s": ttl_s,
            }
        )
        reply = self.request("POST", "/v1/load/safetensors", json=body)
        buffers: list[Buffer] = []
        try:
            for info in reply["buffers"]:
                buffers.append(self._open(info, True))
            return Tensors(buffers, reply["tensors"])
        except BaseException:
            for b in buffers:
                b.close()
            for info in reply["buffers"][len(buffers) + 1 :]:
                self.release(info["buffer_id"])
            raise

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
    ) -> Buffer:
        """Rows of a row-major ``(rows, dim)`` matrix file: by ``indices``, or ``start`` and
        ``count``. The buffer's shape is ``(n, dim)``."""
        idx = None
        if indices is not None:
            idx = np.asarray(indices).reshape(-1).tolist()
        body = _drop_none(
            {
                **_ref(file),
                "dim": dim,
                "dtype": dtype,
                "indices": idx,
                "start": start,
                "count": count,
                "device": device,
                "ttl_s": ttl_s,
            }
        )
        return self._open(self.request("POST", "/v1/vectors/gather", json=body), True)

    def open_buffer(self, buffer_id: str, *, release_on_close: bool = True) -> Buffer:
        """Open an existing lease (e.g. one a ``gpu`` prefetch keeps warm)."""
        return self._open(self.request("GET", f"/v1/buffers/{buffer_id}"), release_on_close)

    # -- leases ----------------------------------------------------------------------------
    def buffers(self) -> dict[str, Any]:
        """Every live lease, and the bytes leased and budget per device."""
        result: dict[str, Any] = self.request("GET", "/v1/buffers")
        return result

    def renew(self, buffer_id: str, ttl_s: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self.request(
            "POST", f"/v1/buffers/{buffer_id}/renew", json=_drop_none({"ttl_s": ttl_s})
        )
        return result

    def release(self, buffer_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self.request("DELETE", f"/v1/buffers/{buffer_id}")
        return result

    # -- prefetch --------------------------------------------------------------------------
    def prefetch(
        self,
        files: FileRef | Sequence[FileRef],
        *,
        target: str = "page_cache",
        device: str | None = None,
        ttl_s: float | None = None,
        wait: bool = False,
        progress: bool = True,
        poll_s: float = 0.2,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Start a prefetch job (``gpu``, ``nvme`` or ``page_cache``); returns the job.

        With ``wait=True`` it follows the job to its end, showing a progress bar on stderr
        (``progress=False``: silently), and returns the final state. Ctrl-C cancels the job.

        Raises
        ------
        JobFailed
            ``wait=True`` and the job failed.
        """
        body = _drop_none({**_refs(files), "target": target, "device": device, "ttl_s": ttl_s})
        job: dict[str, Any] = self.request("POST", "/v1/prefetch", json=body)
        if not wait:
            return job
        try:
            job = self._follow(job, progress, poll_s, timeout)
        except BaseException:
            with contextlib.suppress(TierdClientError):
                self.cancel(job["id"])
            raise
        if job["state"] == "failed":
            raise JobFailed(f"prefetch job {job['id']} failed: {job['error']}", job)
        return job

    def _follow(
        self, job: dict[str, Any], progress: bool, poll_s: float, timeout: float | None
    ) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        finished = ("done", "failed", "cancelled")

        def expired() -> bool:
            return deadline is not None and time.monotonic() > deadline

        if not progress:
            while job["state"] not in finished:
                if expired():
                    raise TimeoutError(f"job {job['id']} still {job['state']}")
                time.sleep(poll_s)
                job = self.job(job["id"])
            return job
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TextColumn("{task.fields[files]}"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
            task = bar.add_task(
                f"prefetch {job['target']}", total=job["bytes_total"] or None, files=""
            )
            while True:
                bar.update(
                    task,
                    completed=job["bytes_done"],
                    files=f"{job['files_done']}/{job['files_total']} files",
                )
                if job["state"] in finished:
                    return job
                if expired():
                    raise TimeoutError(f"job {job['id']} still {job['state']}")
                time.sleep(poll_s)
                job = self.job(job["id"])

    def job(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self.request("GET", f"/v1/jobs/{job_id}")
        return result

    def cancel(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self.request("DELETE", f"/v1/jobs/{job_id}")
        return result

    # -- catalog and service ----------------------------------------------------------------
    def files(
        self, *, tier: str | None = None, prefix: str | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """Files in the catalog (every page, or the first ``limit``)."""
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            page = self.request(
                "GET",
                "/v1/files",
                params=_drop_none({"tier": tier, "prefix": prefix, "cursor": cursor}),
            )
            out.extend(page["items"])
            cursor = page["next_cursor"]
            if cursor is None or (limit is not None and len(out) >= limit):
                return out[:limit] if limit is not None else out

    def file(self, file: FileRef) -> dict[str, Any]:
        """One file's record, by id or relpath."""
        if isinstance(file, int) and not isinstance(file, bool):
            result: dict[str, Any] = self.request("GET", f"/v1/files/{file}")
        else:
            result = self.request("GET", "/v1/files/lookup", params={"path": file})
        return result

    def tiers(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.request("GET", "/v1/tiers")
        return result

    def policy(self) -> dict[str, Any]:
        result: dict[str, Any] = self.request("GET", "/v1/policy")
        return result

    def stats(self) -> dict[str, Any]:
        """The data path's I/O statistics, per I/O path and per tier."""
        result: dict[str, Any] = self.request("GET", "/v1/stats")
        return result
