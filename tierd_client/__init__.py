"""tierd's Python client: REST calls, and leased buffers opened in this process as arrays.

It installs without the server (``pip install tierd`` brings httpx and numpy; the service
needs ``tierd[server]``). CuPy is imported only to open a ``cuda`` buffer, torch only by
:meth:`Tensors.torch`.

>>> from tierd_client import Client
>>> with Client("http://127.0.0.1:8470", token) as tierd:             # doctest: +SKIP
...     with tierd.load("models/llama/shard-0.bin", device="cuda:0") as buf:
...         t = torch.from_dlpack(buf)      # zero copy: the service's GPU allocation
...     with tierd.load("ids.bin", dtype="int64") as buf:
...         a = numpy.asarray(buf)          # zero copy: the service's shared memory

A loaded :class:`Buffer` holds a lease. Closing it (or leaving its ``with`` block) releases
the lease; the mapping itself closes once no array made from it (a tensor, say) is alive, so
such an array never points at unmapped memory. Renew long-lived buffers before ``expires_at``
(:meth:`Buffer.renew`), or the service frees them.

Errors are exceptions carrying the server's code and message; the tree is drawn in
:mod:`tierd_client._exceptions`.
"""

from __future__ import annotations

from ._buffers import Buffer, Tensors, prewarm_cuda
from ._client import Client
from ._exceptions import (
    APIError,
    AuthError,
    Conflict,
    InsufficientSpace,
    InvalidRequest,
    JobFailed,
    NotFound,
    RangeNotSatisfiable,
    ServerError,
    TierdClientError,
    TooLarge,
    TooManyRequests,
    TransportError,
    Unavailable,
)

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

# CuPy's import (0.15-0.3 s) starts here, on a thread: an engine imports its loader, makes
# its client, builds its model, then loads. Started only when the client was made, the import
# was still running at the first load (on the H200 host, 20-70 ms of a 2 GB model's weights
# phase in a fresh process, against the 0.24 s that the import, the set-up and the build give
# it from here). Nothing of CUDA itself is started.
prewarm_cuda()

# Public names report the public module (as httpx does), so reprs and docs say
# ``tierd_client.Client`` rather than ``tierd_client._client.Client``.
for _name in __all__:
    globals()[_name].__module__ = "tierd_client"
del _name
