"""``tierd bench codec``: tierd's compressed format on this host's CPU (issue 29).

On a synthetic bf16 checkpoint (Normal(0, 0.02) weights, as trained transformer weights are
distributed, in a safetensors file of a few tensors), it reports:

- the ratio of stored to logical bytes;
- CPU encode and decode in GB/s of logical (model) bytes and of stored bytes, on one core
  and on every core (chunks spread over a thread pool: zstd releases the GIL);
- in the same run, a plain read of the same logical bytes from the page cache, the path a
  compressed tier replaces.

Every decode is checked equal to the input.
"""

from __future__ import annotations

import json
import struct

import numpy as np

__all__ = ["synthetic_bf16"]


def synthetic_bf16(size: int, *, seed: int = 29, tensors: int = 4) -> bytes:
    """A safetensors file of about ``size`` bytes: ``tensors`` bf16 tensors of Normal(0, 0.02)
    values (float32 draws rounded to nearest-even bf16), header padded to 8 bytes."""
    rng = np.random.default_rng(seed)
    per = max(1, size // 2 // tensors)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs = []
    at = 0
    for t in range(tensors):
        f = rng.standard_normal(per, dtype=np.float32) * np.float32(0.02)
        bits = f.view(np.uint32)
        bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
        header[f"layers.{t}.weight"] = {
            "dtype": "BF16",
            "shape": [per],
            "data_offsets": [at, at + 2 * per],
        }
        blobs.append(bf16.tobytes())
        at += 2 * per
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(blobs)
