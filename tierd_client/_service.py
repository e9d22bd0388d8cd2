"""The service calls of :class:`~tierd_client.Client` that move no bytes into a buffer: leases,
prefetch jobs, and the catalog's and the service's state.

The loads (``load``, ``load_safetensors``, ``gather``, ...) stay in ``_client``, beside the
buffer hand-off they share; these calls are plain JSON requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._loads import drop_none, file_refs
from ._progress import finish

__all__ = ["FileRef", "ServiceMixin"]

FileRef = int | str
"""A catalog file id, or a relpath."""


class ServiceMixin:
    """Leases, prefetch jobs, the catalog; :class:`~tierd_client.Client` sends the requests."""

    if TYPE_CHECKING:

        def request(
            self,
            method: str,
            path: str,
            *,
            json: Any = None,
            params: Mapping[str, Any] | None = None,
        ) -> Any: ...

    # -- leases ----------------------------------------------------------------------------
    def buffers(self) -> dict[str, Any]:
        """Every live lease, and the bytes leased and budget per device."""
        result: dict[str, Any] = self.request("GET", "/v1/buffers")
        return result

    def renew(self, buffer_id: str, ttl_s: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self.request(
            "POST", f"/v1/buffers/{buffer_id}/renew", json=drop_none({"ttl_s": ttl_s})
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
        """Start a prefetch job (``gpu``, ``memory``, ``nvme`` or ``page_cache``); returns the job.

        ``gpu`` keeps each file as a warm, read-only lease (``job["buffer_ids"]``): a resident
        copy that ``shared=True`` loads are handed and other loads copy from. ``memory``
        copies each file into the server's memory tier (pinned host memory; 422 without one).

        With ``wait=True`` it follows the job to its end, showing a progress bar on stderr
        (rich's where installed, else a line of text; ``progress=False``: silently), and
        returns the final state. Ctrl-C, or ``timeout`` seconds passing, cancels the job.

        Raises
        ------
        JobFailed
            ``wait=True`` and the job failed.
        TimeoutError
            ``wait=True`` and the job was still running after ``timeout`` seconds.
        """
        body = drop_none({**file_refs(files), "target": target, "device": device, "ttl_s": ttl_s})
        job: dict[str, Any] = self.request("POST", "/v1/prefetch", json=body)
        if not wait:
            return job
        return finish(
            job,
            self.job,
            self.cancel,
            what=f"prefetch job {job['id']}",
            progress=progress,
            poll_s=poll_s,
            timeout=timeout,
        )

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
                params=drop_none({"tier": tier, "prefix": prefix, "cursor": cursor}),
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
