"""Models as a unit: the ``/v1/models`` calls of :class:`~tierd_client.Client`.

A model is a directory of the store that directly holds safetensors weights (a Hugging Face
model directory), named by its relpath, e.g. ``models/llama-3-8b``.

>>> with Client(url, token) as tierd:                                        # doctest: +SKIP
...     tierd.models(prefix="models/")                       # name, bytes, tiers, heat
...     tierd.prefetch_model("models/llama", target="nvme", wait=True)
...     with tierd.load_model("models/llama", device="cuda:0") as tensors:
...         weights = tensors.torch()                        # {name: tensor}, no copy
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

from ._buffers import Buffer, Tensors
from ._loads import drop_none, model_body, open_tensors, parse_target
from ._progress import finish
from ._service import ServiceMixin

__all__ = ["ModelsMixin"]


class ModelsMixin(ServiceMixin):
    """The model methods, over the service calls (jobs, leases); :class:`~tierd_client.Client`
    provides the plumbing they use."""

    if TYPE_CHECKING:

        def _open_all(self, reply: Mapping[str, Any], wait: bool = True) -> list[Buffer]: ...

    def models(self, prefix: str | None = None) -> list[dict[str, Any]]:
        """Every model (whose name starts with ``prefix``), by name: files, bytes, the tiers
        and heat of its weights, pins, whether it has an index."""
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            page = self.request(
                "GET", "/v1/models", params=drop_none({"prefix": prefix, "cursor": cursor})
            )
            out.extend(page["items"])
            cursor = page["next_cursor"]
            if cursor is None:
                return out

    def model(self, name: str) -> dict[str, Any]:
        """One model: its files (tier, heat, state, pin) and layout (shards, index, tensors).

        Raises
        ------
        NotFound
            No model of that name.
        InvalidRequest
            Its index does not validate (the message says why).
        """
        result: dict[str, Any] = self.request("GET", "/v1/models/lookup", params={"name": name})
        return result

    @overload
    def load_model(
        self,
        name: str,
        *,
        names: Sequence[str] | None = None,
        prefix: str | None = None,
        device: str = "cpu",
        ttl_s: float | None = None,
        shared: bool = False,
        devices: None = None,
        sharding: None = None,
        rank: None = None,
    ) -> Tensors: ...

    @overload
    def load_model(
        self,
        name: str,
        *,
        names: Sequence[str] | None = None,
        prefix: str | None = None,
        device: str = "cpu",
        ttl_s: float | None = None,
        shared: bool = False,
        devices: Sequence[str] | str,
        sharding: Mapping[str, Any] | None = None,
        rank: int | None = None,
    ) -> list[Tensors]: ...

    @overload
    def load_model(
        self,
        name: str,
        *,
        names: Sequence[str] | None = None,
        prefix: str | None = None,
        device: str = "cpu",
        ttl_s: float | None = None,
        shared: bool = False,
        devices: Sequence[str] | str | None = None,
        sharding: Mapping[str, Any],
        rank: int | None = None,
    ) -> list[Tensors]: ...

    def load_model(
        self,
        name: str,
        *,
        names: Sequence[str] | None = None,
        prefix: str | None = None,
        device: str = "cpu",
        ttl_s: float | None = None,
        shared: bool = False,
        devices: Sequence[str] | str | None = None,
        sharding: Mapping[str, Any] | None = None,
        rank: int | None = None,
    ) -> Tensors | list[Tensors]:
        """Load a model's tensors (all, ``names``, or those starting with ``prefix``) into
        ``device``: one buffer per shard, opened here without a copy.

        ``devices``, ``sharding`` and ``rank``: several devices, or a tensor-parallel split,
        one :class:`Tensors` per device, as for :meth:`~tierd_client.Client.load_safetensors`.

        ``shared=True`` promises never to write them: shards resident on ``device`` are
        handed out again (one copy for every process), and the buffers are read-only.

        Close the :class:`Tensors` (or leave its ``with`` block) to release the leases.

        Raises
        ------
        InvalidRequest
            A bad index, a tensor in two shards, a name not in the model; nothing is leased.
        InsufficientSpace
            Over the device's lease budget.
        """
        target = parse_target(device, devices, sharding, rank)
        body = model_body(names, prefix, target, ttl_s, shared)
        reply = self.request("POST", "/v1/models/load", params={"name": name}, json=body)
        return open_tensors(self, target, reply)

    def prefetch_model(
        self,
        name: str,
        *,
        target: str = "page_cache",
        device: str | None = None,
        ttl_s: float | None = None,
        wait: bool = False,
        progress: bool = True,
        poll_s: float = 0.2,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Warm every file of a model with one job (``gpu``, ``memory``, ``nvme`` or
        ``page_cache``); returns the job, or with ``wait=True`` follows it to its end as
        :meth:`~tierd_client.Client.prefetch` does (a progress bar; Ctrl-C or ``timeout``
        cancels it).

        Raises
        ------
        JobFailed
            ``wait=True`` and the job failed.
        TimeoutError
            ``wait=True`` and the job was still running after ``timeout`` seconds.
        """
        body = drop_none({"target": target, "device": device, "ttl_s": ttl_s})
        job: dict[str, Any] = self.request(
            "POST", "/v1/models/prefetch", params={"name": name}, json=body
        )
        if not wait:
            return job
        return finish(
            job,
            self.job,
            self.cancel,
            what=f"prefetch of model {name}",
            progress=progress,
            poll_s=poll_s,
            timeout=timeout,
        )

    def pin_model(self, name: str, tier: str | None = None) -> dict[str, Any]:
        """Pin every file of a model to ``tier`` (default: where most of its weights are), all
        at once; needs the admin token."""
        result: dict[str, Any] = self.request(
            "POST", "/v1/models/pin", params={"name": name}, json=drop_none({"tier": tier})
        )
        return result

    def unpin_model(self, name: str) -> dict[str, Any]:
        """Remove the pins of every file of a model; needs the admin token."""
        result: dict[str, Any] = self.request("DELETE", "/v1/models/pin", params={"name": name})
        return result
