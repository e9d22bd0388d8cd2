"""``tierd bench codec --origin s3like``: the checkpoint in a bucket, plain and compressed, loaded
into the run's device through an object tier (issue 29).

One origin (started by the bench: ``s3like`` is nginx with a per-connection rate cap, as S3
gives about 100 MB/s a connection; ``open`` has no cap; ``moto`` is moto's server) holds the
same checkpoint twice, as tierd's object tier stores it:

- ``raw/model.safetensors``: as it is (what a bucket holds when tierd adopted it);
- ``z/model.safetensors``: the container tierd writes, at ``.tierd-compressed/z/...``.

The origin holds each connection to the rate (see :mod:`._origin`: the kernel paces it where
namespaces can be made); the report's setup says how.

Both are loaded whole, in this process, through one :class:`~tiering.tiers.ObjectTier` with the
run's connections (``--connections``, default the tier's 64): the plain one by the tier's
ranged GETs or KvikIO's ``RemoteFile`` where it wins, the compressed one by GETs of its stored
chunks, decoded on the GPU (nvCOMP) or on the host. Rates are of model bytes; the note gives
the stored bytes' rate; every load is checked equal to the checkpoint. The origin's access log
(nginx) counts what it sent.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from ._measure import gbps
from ._report import BenchRow, Report

__all__ = ["object_rows"]

PREFIX = "codec-bench"


def object_rows(
    report: Report,
    data: bytes,
    stored: bytes,
    device: str,
    repeats: int,
    *,
    origin: str,
    rate: int | None,
    connections: int | None,
    say: Callable[[str], None],
) -> None:
    """Add ``obj_raw`` and ``obj_compressed`` (see the module)."""
    from tiering.config import TierConfig
    from tiering.io import GdsConfig
    from tiering.tiers import make_tier  # an object tier: boto3, the server's

    from ._codec_tiers import load_times
    from ._origin import REGION, open_origin

    where = f"{origin} origin" + (f", {rate / 1e6:.0f} MB/s a connection" if rate else "")
    report.setup |= {"origin": origin, "origin_rate": rate, "connections": connections or 64}
    with tempfile.TemporaryDirectory(prefix="tierd-bench-codec-obj-") as tmp:
        work = Path(tmp)
        (work / "raw").write_bytes(data)
        (work / "z").write_bytes(stored)
        with open_origin(origin, rate=rate, parent=work, say=say) as o:
            report.setup["origin_description"] = o.description
            o.put_file(f"{PREFIX}/raw/model.safetensors", work / "raw")
            o.put_file(f"{PREFIX}/.tierd-compressed/z/model.safetensors", work / "z")
            cfg = TierConfig(
                "s3",
                kind="object",
                url=f"s3://{o.bucket}/{PREFIX}",
                endpoint_url=o.endpoint,
                region=REGION,
                compression="off",
                connections=connections or 64,
            )
            tier = make_tier(cfg, 0)
            try:
                for key, rel, nbytes, label in (
                    ("obj_raw", "raw/model.safetensors", len(data), "plain object"),
                    ("obj_compressed", "z/model.safetensors", len(stored), "compressed object"),
                ):
                    text = f"{label} -> {device}, {where}"
                    say(text)
                    secs, engines = load_times(tier, rel, data, device, GdsConfig(), repeats)
                    note = (
                        f"{gbps(nbytes, secs):.2f} GB/s of stored bytes; "
                        f"engine {', '.join(sorted(engines))}"
                    )
                    report.add(BenchRow(key, text, gbps(len(data), secs), "GB/s", note=note))
            finally:
                tier.close()
    report.compare("obj_compressed", "obj_raw", 1.35)
