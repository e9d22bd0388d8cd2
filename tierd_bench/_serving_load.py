"""The large load of ``tierd bench serving`` (:mod:`tierd_bench.serving`): an object on a fast
origin that the server loads whole, again and again, while the clients' small requests run.

With ``origin`` (``open``: nginx on loopback with no cap; ``s3like``; ``moto``) the bench puts
one object of ``load_size`` bytes on the origin and gives the server an ``s3`` tier on it,
beside its directory tiers, so the scan adopts it in place (the policy is off: nothing
promotes it). A loader thread of the bench then loads it whole into ``device`` through
:mod:`tierd_client` (a torch tensor on ``cuda:N`` through CUDA IPC, a NumPy array over shared
memory on ``cpu``) and releases it, back to back, as an inference process starting would. The
first load's bytes are checked against the object's checksum before any window.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tiering.checksum import Hasher

from ._datafiles import write_random
from ._measure import GiB
from ._origin import REGION, open_origin
from .rest import materialiser

__all__ = ["LOAD_ORIGINS", "MODEL", "check_load", "load_once", "origin_settings"]

LOAD_ORIGINS = ("open", "s3like", "moto")
MODEL = "model.bin"


@contextlib.contextmanager
def origin_settings(
    spec: str, data: Path, size: int, say: Any
) -> Iterator[tuple[dict[str, str], str]]:
    """Start origin ``spec`` holding the object; yields the server's settings (its tiers: the
    default directories under ``data`` and ``s3`` on the origin) and the object's checksum."""
    with open_origin(spec, rate=None, parent=data.parent, say=say) as origin:
        src = data.parent / "origin-object" / MODEL
        src.parent.mkdir(parents=True)
        checksum = write_random(src, size)
        prefix = f"serving-{secrets.token_hex(4)}"
        origin.put_file(f"{prefix}/{MODEL}", src)
        tiers: list[dict[str, Any]] = [
            {"name": n, "path": str(data / n)} for n in ("nvme", "ssd", "hdd")
        ]
        tiers.append(
            {
                "name": "s3",
                "url": f"s3://{origin.bucket}/{prefix}",
                "endpoint_url": origin.endpoint,
                "region": REGION,
            }
        )
        env = {
            "TIERD_TIERS": json.dumps(tiers),
            # The load's buffer, the clients' 1 MiB loads and their leases beside it.
            "TIERD_BUFFERS__CPU_BUDGET_BYTES": str(max(4 * GiB, 3 * size)),
        }
        yield env, checksum


def load_once(api: Any, fid: int, device: str) -> None:
    """Load file ``fid`` whole into ``device`` and make it usable here, then release it."""
    buf = api.load(fid, device=device)
    try:
        view = materialiser(device)(buf)
        del view  # the tensor or array goes before the mapping it views
    finally:
        buf.close()


def check_load(api: Any, fid: int, device: str, want: str) -> float:
    """One load of ``fid`` into ``device`` with its bytes checked against ``want``; returns its
    seconds (the load alone, the check off the clock)."""
    t0 = time.monotonic()
    buf = api.load(fid, device=device)
    try:
        view = materialiser(device)(buf)
        seconds = time.monotonic() - t0
        host = view.cpu().numpy() if device.startswith("cuda") else np.asarray(view)
        h = Hasher()
        h.update(np.ascontiguousarray(host).view(np.uint8).data)
        del view, host
    finally:
        buf.close()
    if h.value() != want:
        raise AssertionError(f"the large load's bytes differ ({h.value()} != {want})")
    return seconds
